"""The documentation site (issue 53): ``mkdocs build --strict`` builds it (a broken reference, a missing public name
or a dead link fails), the API reference has an entry for every public name, the troubleshooting page covers every
exported exception and the migration guide every DeepSpeed ``safe_*`` function, and the versions the README states
are those ``pyproject.toml`` requires. Needs the ``docs`` extra (``pip install -e ".[docs]"``; CI installs it)."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import zero_dtensor as zd

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
EXCEPTIONS = sorted(n for n in zd.__all__ if isinstance(getattr(zd, n), type) and issubclass(getattr(zd, n), Exception))


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of ``text`` (up to the next heading of level 2 or higher)."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^#{{1,2}} |\Z)", text, flags=re.M | re.S)
    assert match, f"no section '## {heading}'"
    return match.group(1)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as exc:  # not a skip: the suite's CI installs the docs extra
        pytest.fail(f"the docs site needs the docs extra: pip install -e '.[docs]' ({exc})")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}"
    return out


def test_the_site_builds_in_strict_mode_with_every_page(site: pathlib.Path) -> None:
    pages = {"index.html", "reference/index.html", "troubleshooting/index.html", "migration/index.html",
             "guide/index.html", *(f"notebooks/{p.stem}/index.html" for p in (ROOT / "notebooks").glob("*.ipynb"))}
    assert {p for p in pages if not (site / p).is_file()} == set()
    notebook = (site / "notebooks" / "01_quickstart" / "index.html").read_text()
    assert "data:image/png;base64," in notebook  # the committed plots are on the page


def test_every_public_name_has_a_reference_entry(site: pathlib.Path) -> None:
    directives = set(re.findall(r"^::: zero_dtensor\.(\w+)\s*$", REFERENCE.read_text(), flags=re.M))
    assert set(zd.__all__) - directives == set(), "add a '::: zero_dtensor.NAME' entry to docs/reference.md"
    html = (site / "reference" / "index.html").read_text()
    rendered = {name for name in zd.__all__ if f'id="zero_dtensor.{name}"' in html}
    assert set(zd.__all__) - rendered == set()
    assert 'id="zero_dtensor.lightning.ZeroGradCallback"' in html
    for method in ("full_tensors", "norms", "clip_grad_norm_", "to_dtensors", "map_full_", "set_full_"):
        assert f'id="zero_dtensor.ShardedTensors.{method}"' in html  # inherited methods are rendered too


def test_a_dead_link_is_a_warning_that_fails_strict_mode(caplog) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_site
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    page = ROOT / "docs" / "guide.md"
    with caplog.at_level(logging.WARNING, logger="mkdocs.plugins.zero_dtensor"):
        kept = docs_site.rewrite_links("[gone](nothing-here.md) [ok](../README.md#install) [ex](../examples/ema.py)",
                                       page)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "nothing-here.md" in caplog.text
    assert "[ok](index.md#install)" in kept and "`examples/ema.py`" in kept


def test_troubleshooting_covers_every_exported_exception() -> None:
    assert len(EXCEPTIONS) == 13, EXCEPTIONS  # the twelve of 0.2.0 and zd.convert's ConversionError
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    for name in EXCEPTIONS:
        body = _section(text, f"`{name}`")
        for part in ("**Cause.**", "**Message.**", "**Fix.**"):
            assert part in body, f"troubleshooting.md: {name} has no {part}"
    for mistake in ("outside the backward", "different calls", "gloo"):
        assert mistake in text.lower(), mistake


def test_migration_covers_every_safe_function() -> None:
    import deepspeed.utils

    functions = sorted(n for n in dir(deepspeed.utils) if n.startswith("safe_"))
    assert len(functions) >= 12, functions
    text = (ROOT / "docs" / "migration.md").read_text()
    for name in functions:
        body = _section(text, f"`{name}`")
        assert "```diff" in body and re.search(r"^-.*" + name, body, flags=re.M), f"migration.md: no diff for {name}"
    for topic in ("zero_to_fp32", "ds_to_universal", "FSDP2"):
        assert "```diff" in _section(text, next(h for h in re.findall(r"^## (.+)$", text, flags=re.M) if topic in h))


def test_one_truth_for_versions() -> None:
    """pyproject's bounds are what ran; the README's status box and CHANGELOG say the same."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
    torch_min = re.search(r">=([\d.]+)", deps["torch"]).group(1)
    readme = (ROOT / "README.md").read_text()
    assert f"| torch | {torch_min} and newer" in readme
    assert deps["deepspeed"] == "deepspeed>=0.18.9,<0.20" and "| DeepSpeed | 0.18.9 to 0.19.x" in readme
    assert project["version"] == zd.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{zd.__version__}] - " in changelog and "## [Unreleased]" in changelog
    assert "torch 2.6" not in changelog and f"torch {torch_min}" in changelog


def test_readme_is_short_and_its_cells_are_short() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    cells = [c for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines() if line.startswith("|")
             for c in line.strip().strip("|").split("|")]
    assert cells and max(map(len, cells)) <= 200, max(cells, key=len)
