"""What checking every tensor entry's CRC-32 costs ``zero_dtensor.checkpoint.load`` (CPU, gloo ranks, one process
per rank): an interleaved A/B in one process. A is the load with the checks patched out (what the load did before
them: deferred entries are not read in the first pass, nothing is CRC-ed, no descriptor is read); B is the load as
it is. Each round runs both, in an order that alternates from round to round, each timed from a barrier to a
barrier after an untimed ``os.sync()`` (``checkpoint_io._timed``). The checkpoint is read from the page cache (it
was just written), so the figures are the CPU cost of the checks, not disk time. Prints rank 0's medians and
spreads, and B / A of the medians. Example (about 20 s on 2 shared cores)::

    python benchmarks/checkpoint_crc_cost.py --nproc 2 --stage 2 --hidden 256 --layers 4 --repeat 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoint_io import _engine, _timed  # noqa: E402

from zero_dtensor.bench.model import count  # noqa: E402
from zero_dtensor.checkpoint import load, reader, save  # noqa: E402
from zero_dtensor.launch import launch  # noqa: E402


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """The reader without its CRC-32 checks (the load before them)."""
    read_to = reader._read_to
    with mock.patch.object(reader.DirectReader, "_check_record", lambda *a: None), \
            mock.patch.object(reader.DirectReader, "_recorded", lambda *a: 0), \
            mock.patch.object(reader, "_check_loaded", lambda *a: None), \
            mock.patch.object(reader, "_read_to", lambda s, t, i, crc=False: read_to(s, t, i)):
        yield


def ab(hidden: int, layers: int, stage: int, root: str, repeat: int) -> dict[str, Any]:
    engine = _engine(hidden, layers, stage)
    path = os.path.join(root, "ckpt")
    save(engine, path)
    times: dict[str, list[float]] = {"A: unchecked": [], "B: CRC-32 checked": []}
    for r in range(repeat):
        for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
            context = unchecked() if name.startswith("A") else contextlib.nullcontext()
            with context:
                times[name].append(_timed(lambda: load(engine, path))[0])
    rows: dict[str, Any] = {k: {"median_s": round(statistics.median(v), 4), "spread_s": [round(min(v), 4),
                                                                                          round(max(v), 4)]}
                            for k, v in times.items()}
    rows["B / A (medians)"] = round(statistics.median(times["B: CRC-32 checked"])
                                    / statistics.median(times["A: unchecked"]), 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--dir", default="/tmp/zd-crc-bench")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    params, tensors = count(args.hidden, args.layers)
    report = {"params": params, "tensors": tensors, "nproc": args.nproc, "stage": args.stage, "repeat": args.repeat,
              "rank 0": launch(ab, args.hidden, args.layers, args.stage, args.dir, args.repeat, nprocs=args.nproc,
                               timeout=600)}
    print(json.dumps(report, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
