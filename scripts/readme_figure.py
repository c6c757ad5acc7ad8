"""The benchmark figure of docs/benchmarks.md from one benchmark run: ``python -m zero_dtensor.bench --json
bench.json`` then ``python scripts/readme_figure.py bench.json docs/figures/benchmark.png``.

Per ZeRO stage: DeepSpeed's per-parameter ``safe_get_full_grad`` loop against one ``full_tensors()`` call and the
bare gathers of the same
bytes: the isend/irecv batch and ``all_gather_into_tensor`` (median ms of the slowest rank, from the JSON's rows).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROWS = (("ds get loop", "DeepSpeed safe_get_full_grad loop"), ("full_tensors", "zero_dtensor full_tensors()"),
        ("ref: bare send_recv gather", "bare isend/irecv batch (floor: the cheapest)"),
        ("floor: bare all_gather", "bare all_gather_into_tensor"))


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=pathlib.Path)
    parser.add_argument("png", type=pathlib.Path)
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    stages = sorted(data["stages"], key=int)
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    width = 0.8 / len(ROWS)
    for k, (prefix, label) in enumerate(ROWS):
        values = []
        for stage in stages:
            rows = [r for r in data["rows"] if str(r["stage"]) == stage and r["row"].startswith(prefix)]
            values.append(1e3 * rows[0]["median_s"])
        ax.bar([i + (k - (len(ROWS) - 1) / 2) * width for i in range(len(stages))], values, width, label=label)
    ax.set_xticks(range(len(stages)), [f"ZeRO-{s}" for s in stages])
    ax.set_ylabel("ms (median, slowest rank)")
    meta = data["stages"][stages[0]]
    ax.set_title(f"every gradient of a {meta['params'] / 1e6:.0f}M-parameter, {meta['tensors']}-tensor model, "
                 f"{data['world_size']} {data['backend']} ranks", fontsize=10)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
