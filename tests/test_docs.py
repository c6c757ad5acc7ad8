"""The user's documents hold: every relative link resolves, no table row is malformed, and every Python block of the
README runs (on 2 gloo ranks, against a real engine, checked against DeepSpeed)."""

from __future__ import annotations

import pathlib
import re

import pytest

from workers import docs

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "x", text)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_relative_links_resolve(path: pathlib.Path) -> None:
    missing = []
    for target in _LINK.findall(_outside_code(path.read_text())):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # web addresses and in-page anchors
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{path.name}: links to missing files {missing}"


def _cells(row: str) -> int:
    return len(re.sub(r"\\\|", "x", row).strip().removeprefix("|").removesuffix("|").split("|"))


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_tables_are_well_formed(path: pathlib.Path) -> None:
    bad, header, rule = [], None, False
    for number, line in enumerate(_outside_code(path.read_text()).splitlines(), 1):
        if not line.startswith("|"):
            header, rule = None, False
            continue
        if header is None:
            header = _cells(line)
        elif not rule:
            rule = True
            if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                bad.append((number, "no separator row under the header"))
        if _cells(line) != header:
            bad.append((number, f"{_cells(line)} cells under a header of {header}"))
    assert not bad, f"{path.name}: {bad}"


def test_the_table_reader_counts_cells_as_a_renderer_does() -> None:
    assert _cells(_outside_code("| a | `x | y` | c |")) == 3  # a pipe inside inline code is not a boundary
    assert _cells(r"| a | b \| c |") == 2  # nor an escaped one
    assert _cells("| a | b | c | d |") == 4  # a row with a pasted cell is seen


_BLOCK = re.compile(r"(?:<!-- readme-block: (\w+) -->\n)?```python\n(.*?)```", flags=re.S)
_RUNNERS = {"plain": docs.run_readme_block, "hook": docs.run_readme_hook_block}


def _readme_blocks() -> list[tuple[str | None, str]]:
    return _BLOCK.findall((ROOT / "README.md").read_text())


def test_every_readme_python_block_says_how_it_runs() -> None:
    blocks = _readme_blocks()
    assert blocks, "the README has no Python example"
    kinds = [kind for kind, _ in blocks]
    assert all(kind in (*_RUNNERS, "checkpoint", "lightning") for kind in kinds), kinds
    assert {"plain", "hook", "checkpoint", "lightning"} <= set(kinds), "each loop of 'Pick your loop' has a block"


def test_readme_python_blocks_run(ranks, tmp_path) -> None:
    for kind, block in _readme_blocks():
        if kind in _RUNNERS:
            ranks(2).run(_RUNNERS[kind], block)
        elif kind == "checkpoint":
            ranks(2).run(docs.run_readme_checkpoint_block, block, str(tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"))


def test_readme_lightning_block_runs(ranks) -> None:
    pytest.importorskip("lightning", reason="the lightning extra (CI installs it with .[test])")
    blocks = [block for kind, block in _readme_blocks() if kind == "lightning"]
    assert blocks
    for block in blocks:
        counts = ranks(2).run(docs.run_readme_lightning_block, block)
        assert all(c and set(c.values()) == {4} for c in counts), counts  # 4 boundaries: workers/lightning.STEPS
