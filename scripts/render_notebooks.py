"""Execute every tutorial notebook from a clean kernel and save it with its outputs and plots, so that a reader on
the web sees the results: ``python scripts/render_notebooks.py [NAME ...]``.

Outputs are cleaned before saving: absolute paths of this machine become ``…``, DeepSpeed's op-build and linker chatter
and the kernel's warnings are dropped, execution timestamps are removed. The tests execute the notebooks again from
a clean kernel (``tests/test_notebooks.py``); what is committed is only for reading.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
#: stream lines that say nothing to a reader (DeepSpeed's accelerator and op-build messages, linker output, the
#: kernel's transport warning, torch's deprecation warnings)
NOISE = re.compile(r"real_accelerator\.py|\[WARNING\]|\[INFO\]|ninja|g\+\+|c\+\+|/usr/bin/ld|collect2|Building extension"
                   r"|Loading extension|Emitting ninja|FutureWarning|UserWarning|DeprecationWarning|warnings\.warn"
                   r"|return func\(\*args|Kernel is running over TCP")


def _paths() -> list[str]:
    """Absolute prefixes that must not reach a committed notebook, longest first."""
    found = {str(ROOT), os.path.expanduser("~"), sys.prefix, sys.base_prefix, "/tmp"}
    return sorted((p for p in found if p and p != "/"), key=len, reverse=True)


def _clean_text(text: str, prefixes: list[str]) -> str:
    lines = [line for line in text.splitlines(keepends=True) if not NOISE.search(line)]
    text = "".join(lines)
    for prefix in prefixes:
        text = text.replace(prefix, "…")
    return text


def clean(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop noise and machine paths from every output; drop execution timestamps."""
    prefixes = _paths()
    for cell in notebook.cells:
        cell.get("metadata", {}).pop("execution", None)
        outputs = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = _clean_text(output["text"], prefixes)
                if not output["text"].strip():
                    continue
            elif "data" in output and "text/plain" in output["data"]:
                output["data"]["text/plain"] = _clean_text(output["data"]["text/plain"], prefixes)
            outputs.append(output)
        if "outputs" in cell:
            cell["outputs"] = outputs
    return notebook


def render(path: pathlib.Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(clean(notebook), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook file names (default: all in notebooks/)")
    args = parser.parse_args(argv)
    paths = [NOTEBOOKS / n for n in args.names] if args.names else sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        render(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
