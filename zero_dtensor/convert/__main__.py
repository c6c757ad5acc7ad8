"""``python -m zero_dtensor.convert SRC DST [--to dcp|safetensors] [--tag TAG] [--dtype fp32|bf16|fp16]``: convert
a DeepSpeed checkpoint folder offline (:func:`zero_dtensor.convert.convert`), with a progress bar (bytes written out
of the total, and the rate)."""

from __future__ import annotations

import argparse
import sys

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..errors import ConversionError
from . import convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_dtensor.convert", description=(
        "Convert a checkpoint that DeepSpeed's engine.save_checkpoint wrote (ZeRO-1/2/3, BF16_Optimizer) into a "
        "torch.distributed.checkpoint (DCP) checkpoint that zero_dtensor.load reads at any world size and stage "
        "(and FSDP2 through torch.distributed.checkpoint), or into Hugging Face safetensors weights."))
    parser.add_argument("src", help="the folder engine.save_checkpoint wrote (with its 'latest' file), or a tag folder")
    parser.add_argument("dst", help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--to", choices=("dcp", "safetensors"), default="dcp")
    parser.add_argument("--tag", default=None, help="the tag folder to convert (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="--to safetensors: the floating-point dtype written")
    parser.add_argument("--max-shard-size", default="5GB", help="--to safetensors: the largest file (e.g. 5GB)")
    parser.add_argument("--no-fsync", action="store_true",
                        help="--to dcp: leave the flush to the operating system (as DeepSpeed's own tools do)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    columns = (TextColumn("[bold]converting"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, disable=args.quiet, transient=False) as bar:
        task = bar.add_task("convert", total=None)
        try:
            convert(args.src, args.dst, tag=args.tag, to=args.to, dtype=args.dtype,
                    max_shard_size=args.max_shard_size, sync_files=not args.no_fsync,
                    progress=lambda done, total: bar.update(task, completed=done, total=total))
        except ConversionError as exc:
            bar.stop()
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if not args.quiet:
        print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
