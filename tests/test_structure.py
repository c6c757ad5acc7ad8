"""The package's structure, read from the source: imports point one way (no module imports, at run time, one that
imports it back); every ``torch.distributed`` call of the library is in its communication modules
(:data:`COMMUNICATION`); only ``zero_dtensor/_deepspeed/`` reads DeepSpeed's private state.

Read from the source with ``ast`` (nothing is imported or run): every ``from . import``/``from .x import`` and
``from zero_dtensor... import``, at module level or inside a function (a function-level import that closes a
circle is the circle put off, not removed). Imports under ``if TYPE_CHECKING:`` are left out: they name types for
annotations and never run.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zero_dtensor"


def _module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imported(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that ``module`` imports at run time."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif node.module and node.module.split(".")[0] == "zero_dtensor":
                    target = node.module
                else:
                    target = ""
                if target:
                    submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                    found.update(submodules if len(submodules) == len(node.names) else submodules | {target})
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(inner)
            for handler in getattr(node, "handlers", []):
                visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    found &= modules.keys()
    found.discard(module)
    # importing ``zero_dtensor.x`` runs ``zero_dtensor/__init__`` first, which every module inside it may rely on
    return {m for m in found if not module.startswith(m + ".")}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return circles


def test_no_runtime_import_circles() -> None:
    modules = _module_names()
    edges = {m: _imported(m, path, modules) for m, path in modules.items()}
    assert len(modules) > 20 and sum(map(len, edges.values())) > 50  # the reader sees the package's imports
    assert _circles(edges) == [], "modules that import each other at run time (directly or through others)"


@pytest.mark.parametrize("source, expected", [
    ("from .b import f\n", {"pkg.b"}),
    ("def g():\n    from .b import f\n", {"pkg.b"}),  # put off is still a circle
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import T\n", set()),
    ("from . import b\n", {"pkg.b"}),
])
def test_the_reader_sees_each_kind_of_import(tmp_path: pathlib.Path, source: str, expected: set[str]) -> None:
    (tmp_path / "a.py").write_text(source)
    modules = {"pkg": tmp_path / "__init__.py", "pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    assert _imported("pkg.a", modules["pkg.a"], modules) == expected
    assert _circles({"pkg.a": expected, "pkg.b": {"pkg.a"}, "pkg": set()}) == ([["pkg.a", "pkg.b"]] if expected
                                                                              else [])


#: entry points that start process groups or time bare collectives (the benchmark's floor) themselves: the
#: ``bench/`` subpackage and these modules
TOOLS = ("demo.py", "launch.py")


def _is_tool(path: pathlib.Path) -> bool:
    return path.name in TOOLS or "bench" in path.relative_to(PACKAGE).parts[:-1]


def _distributed_calls(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every call of a ``torch.distributed`` function (``dist.f(...)``,
    ``torch.distributed.f(...)``, ``dist.group.WORLD.f(...)``); types and attributes that are not called aside."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        chain, fn = [], node.func
        while isinstance(fn, ast.Attribute):
            chain.append(fn.attr)
            fn = fn.value
        chain.reverse()
        if isinstance(fn, ast.Name) and (fn.id == "dist" or (fn.id == "torch" and chain[:1] == ["distributed"])):
            calls.append((node.lineno, ".".join([fn.id, *chain])))
    return sorted(calls)


#: the modules that call ``torch.distributed``: collectives, point-to-point exchanges, process-group queries
COMMUNICATION = ("zero_dtensor.comm.collectives", "zero_dtensor.comm.point_to_point", "zero_dtensor.comm.process_groups")


def _module_of(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_every_distributed_call_is_in_the_communication_modules() -> None:
    found = {str(path.relative_to(PACKAGE)): calls for path in sorted(PACKAGE.rglob("*.py"))
             if _module_of(path) not in COMMUNICATION and not _is_tool(path)
             and (calls := _distributed_calls(path.read_text()))}
    assert found == {}, f"call these through one of zero_dtensor's {', '.join(COMMUNICATION)}"
    paths = {_module_of(path): path for path in PACKAGE.rglob("*.py")}
    per_module = {name: len(_distributed_calls(paths[name].read_text())) for name in COMMUNICATION}
    assert all(per_module.values()) and sum(per_module.values()) > 20, per_module  # the reader sees them there


def test_the_call_reader_sees_each_spelling() -> None:
    source = ("import torch\nimport torch.distributed as dist\n"
              "def f(g: dist.ProcessGroup):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n"
              "    dist.group.WORLD.size()\n    return dist.ReduceOp.SUM\n")
    assert _distributed_calls(source) == [(4, "dist.all_reduce"), (5, "torch.distributed.barrier"),
                                          (6, "dist.group.WORLD.size")]


#: names under which the library holds DeepSpeed objects
DEEPSPEED_OBJECTS = frozenset({"engine", "optimizer", "opt"})


def _deepspeed_private_reads(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every ``import deepspeed...``, every ``engine._x`` / ``optimizer._x`` / ``opt._x`` (also
    ``x.engine._y``), and every ``getattr``/``hasattr``/``setattr`` of an underscore name on anything but ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [(node.lineno, f"import {n}") for n in names if n.split(".")[0] == "deepspeed"]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in DEEPSPEED_OBJECTS:
                found.append((node.lineno, f"{name}.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__")
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(found)


def test_only_the_adapters_read_deepspeed_private_state() -> None:
    found = {str(path.relative_to(PACKAGE)): reads for path in sorted(PACKAGE.rglob("*.py"))
             if "_deepspeed" not in path.relative_to(PACKAGE).parts and not _is_tool(path)
             and (reads := _deepspeed_private_reads(path.read_text()))}
    assert found == {}, "move what reads DeepSpeed's internals into zero_dtensor/_deepspeed/"
    adapters = [_deepspeed_private_reads(p.read_text()) for p in (PACKAGE / "_deepspeed").glob("*.py")]
    assert sum(map(len, adapters)) > 10  # the reader sees the adapters' reads


def test_the_private_state_reader_sees_each_spelling() -> None:
    source = ("from deepspeed.runtime.engine import DeepSpeedEngine\n"
              "def f(engine, self):\n    engine._running_engine_step = False\n"
              "    self.engine._stop_timers()\n    hasattr(engine, '_x')\n    getattr(self, '_y')\n"
              "    engine.optimizer.step()\n    engine.__dict__\n")
    assert _deepspeed_private_reads(source) == [(1, "import deepspeed.runtime.engine"),
                                                (3, "engine._running_engine_step"), (4, "engine._stop_timers"),
                                                (5, "hasattr(..., '_x')")]
