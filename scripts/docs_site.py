"""MkDocs hooks of the documentation site (``mkdocs.yml``): the README becomes the home page, the CHANGELOG a page
and each committed, rendered notebook (``notebooks/*.ipynb``) a page, all generated at build time with no extra
plugin; links between the repository's documents are rewritten to the site's pages.

A relative link to a file of the repository that the site does not hold (an example script) becomes the file's
path in code; a relative link to a file that does not exist is reported as a warning, which fails ``mkdocs build
--strict``.
"""

from __future__ import annotations

import base64
import json
import logging
import pathlib
import posixpath
import re
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.zero_dtensor")
ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")
_FENCE = re.compile(r"(```.*?```)", flags=re.S)


def _site_target(source: pathlib.Path, target: str) -> str | None:
    """Where the relative link ``target`` of the repository file ``source`` points in the site (relative to the
    page ``source`` becomes), or None if the site does not hold that file."""
    path, _, anchor = target.partition("#")
    real = (source.parent / path).resolve()
    if real == ROOT / "README.md":
        site = "index.md"
    elif real == ROOT / "CHANGELOG.md":
        site = "changelog.md"
    elif real.parent == ROOT / "notebooks" and real.suffix == ".ipynb":
        site = f"notebooks/{real.stem}.md"
    elif real.is_relative_to(DOCS):
        site = real.relative_to(DOCS).as_posix()
    else:
        return None
    page = _page_of(source)
    relative = posixpath.relpath(site, posixpath.dirname(page) or ".")
    return relative + (f"#{anchor}" if anchor else "")


def _page_of(source: pathlib.Path) -> str:
    if source == ROOT / "README.md":
        return "index.md"
    if source == ROOT / "CHANGELOG.md":
        return "changelog.md"
    if source.suffix == ".ipynb":
        return f"notebooks/{source.stem}.md"
    return source.relative_to(DOCS).as_posix()


def rewrite_links(markdown: str, source: pathlib.Path) -> str:
    """``markdown`` (of the repository file ``source``) with its relative links pointing at the site's pages."""

    def link(match: re.Match[str]) -> str:
        label, target = match.groups()
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        if not (source.parent / target.split("#")[0]).exists():
            log.warning("%s links to a missing file: %s", source.relative_to(ROOT), target)
            return match.group(0)
        site = _site_target(source, target)
        if site is not None:
            return f"{label}({site})"
        repo_path = (source.parent / target.split("#")[0]).resolve().relative_to(ROOT).as_posix()
        return f"{label[1:-1] if not label.startswith('!') else label} (`{repo_path}`)"

    parts = _FENCE.split(markdown)  # links inside code blocks stay as written
    return "".join(part if part.startswith("```") else _LINK.sub(link, part) for part in parts)


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def notebook_markdown(path: pathlib.Path) -> str:
    """A committed notebook as a page: its markdown cells, its code in Python blocks, its saved outputs (text in
    text blocks, plots as embedded PNG images)."""
    notebook = json.loads(path.read_text())
    out: list[str] = []
    for cell in notebook["cells"]:
        source = _text(cell.get("source", ""))
        if cell["cell_type"] == "markdown":
            out.append(source)
        elif cell["cell_type"] == "code":
            out.append(f"```python\n{source}\n```")
            for output in cell.get("outputs", []):
                if output.get("output_type") == "stream":
                    out.append(f"```text\n{_text(output['text']).rstrip()}\n```")
                    continue
                data = output.get("data", {})
                if "image/png" in data:
                    png = "".join(data["image/png"].split())
                    base64.b64decode(png, validate=True)  # a damaged image fails the build
                    out.append(f"![output](data:image/png;base64,{png})")
                elif "text/plain" in data:
                    out.append(f"```text\n{_text(data['text/plain']).rstrip()}\n```")
    return rewrite_links("\n\n".join(out) + "\n", path)


def on_files(files: Files, config: Any) -> Files:
    """Add the generated pages: ``index.md`` from the README, ``notebooks/NAME.md`` per notebook."""
    readme = ROOT / "README.md"
    files.append(File.generated(config, "index.md", content=rewrite_links(readme.read_text(), readme)))
    changelog = ROOT / "CHANGELOG.md"
    files.append(File.generated(config, "changelog.md", content=rewrite_links(changelog.read_text(), changelog)))
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        files.append(File.generated(config, f"notebooks/{path.stem}.md", content=notebook_markdown(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """The guide pages' links to the README and the notebooks point at the generated pages."""
    if page.file.generated_by is not None:
        return markdown  # rewritten when generated
    return rewrite_links(markdown, DOCS / page.file.src_uri)
