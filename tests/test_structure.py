"""The package's structure, read from the source: folders by role in a declared order of layers (:data:`LAYERS`),
every import pointing down or sideways within its layer, no import circle; the top level holds only the entry
points and the folders; every ``torch.distributed`` call of the library is in its communication modules
(:data:`COMMUNICATION`); only ``zero_dtensor/_deepspeed/`` reads DeepSpeed's private state.

Read from the source with ``ast`` (nothing is imported or run): every ``from . import``/``from .x import`` and
``from zero_dtensor... import``, at module level or inside a function (a function-level import that closes a
circle is the circle put off, not removed), and under ``if TYPE_CHECKING:`` too (types that name each other are
one concept cut in two: they belong in one module, or one names the other through a protocol).
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "zero_dtensor"

#: the layers of the package, bottom first: a module may import from its own layer or a lower one, never a higher
#: one. An entry is a folder (every module in it) or a module; the root package (``zero_dtensor/__init__``, the
#: public names) sits on top of everything.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("zero_dtensor.errors", "zero_dtensor.settings"),  # leaves: exceptions, process-wide settings
    ("zero_dtensor.layout",),  # where every element lives: layouts, placements, plans; no communication
    ("zero_dtensor.comm",),  # transport: process groups, collectives, point-to-point, the agreement
    ("zero_dtensor.core",),  # one family's storage and state
    ("zero_dtensor._deepspeed",),  # the adapters: DeepSpeed's private state read into storages
    ("zero_dtensor.materialize", "zero_dtensor.redistribute", "zero_dtensor.ops"),  # what a call does to the shards
    ("zero_dtensor.families",),  # the objects users hold
    ("zero_dtensor.api", "zero_dtensor.checkpoint", "zero_dtensor.convert"),  # entry points
    ("zero_dtensor.integrations", "zero_dtensor.lightning"),  # training-loop integrations
    ("zero_dtensor.launch", "zero_dtensor.demo", "zero_dtensor.bench"),  # tools: local ranks, the tour, benchmark
    ("zero_dtensor",),
)

#: what the top level of ``zero_dtensor/`` holds besides the folders of :data:`LAYERS`: the package, the entry
#: points (``api``, ``errors``, ``settings``) and the documented paths users import or run
#: (``zero_dtensor.lightning``, ``zero_dtensor.launch``, ``python -m zero_dtensor.demo``)
TOP_LEVEL_MODULES = frozenset({"__init__.py", "api.py", "errors.py", "settings.py", "lightning.py", "launch.py",
                               "demo.py"})


def _module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imported(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that ``module`` imports (at run time or for annotations)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
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


@functools.cache
def _edges() -> dict[str, set[str]]:
    modules = _module_names()
    return {m: _imported(m, path, modules) for m, path in modules.items()}


def _layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """The index in ``layers`` of the longest entry that is ``module`` or a package holding it (the root package
    only for itself); ``None`` where no entry holds it."""
    root = layers[-1][0]
    held = [(len(entry), i) for i, layer in enumerate(layers) for entry in layer
            if module == entry or (entry != root and module.startswith(entry + "."))]
    return max(held)[1] if held else None


def test_no_import_circles() -> None:
    edges = _edges()
    assert len(edges) > 20 and sum(map(len, edges.values())) > 50  # the reader sees the package's imports
    assert _circles(edges) == [], "modules that import each other (directly or through others)"


def test_every_module_is_in_a_layer() -> None:
    assert [m for m in sorted(_module_names()) if _layer_of(m) is None] == [], "add the folder or module to LAYERS"


def test_imports_point_down() -> None:
    """Every import goes to the importer's own layer or a lower one (:data:`LAYERS`)."""
    edges = _edges()
    layer = {m: _layer_of(m) for m in edges}
    up = sorted(f"{m} (layer {layer[m]}) imports {t} (layer {layer[t]})" for m, targets in edges.items()
                for t in targets if None not in (layer[m], layer[t]) and layer[t] > layer[m])
    assert up == []
    layered = {layer[t] for targets in edges.values() for t in targets}
    assert len(layered) >= len(LAYERS) - 2  # the reader sees imports into (almost) every layer


def test_the_top_level_holds_entry_points_and_folders() -> None:
    files = {p.name for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    declared = {entry.split(".")[1] for layer in LAYERS for entry in layer if entry.count(".") == 1}
    assert files == TOP_LEVEL_MODULES, "put the module into the folder of its role (LAYERS)"
    assert folders == declared - {name.removesuffix(".py") for name in TOP_LEVEL_MODULES}


#: one concept per module: a module longer than this is two concepts (the package's rule is "about 450 lines")
MAX_MODULE_LINES = 460


def test_no_module_is_over_about_450_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, "cut the module in two along its concepts"


def test_every_module_says_what_it_is_for() -> None:
    """Every module has a docstring (its first line says what the module is for), and every folder's ``__init__``
    names each module of the folder (``:mod:`.name```) in saying what the folder holds."""
    missing = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip())
    assert missing == []
    unnamed = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__"))
        if absent := [m for m in modules if f":mod:`.{m}`" not in doc]:
            unnamed[init.parent.name] = absent
    assert unnamed == {}, "say in the folder's __init__ docstring what these modules are for"


@pytest.mark.parametrize("source, expected", [
    ("from .b import f\n", {"pkg.b"}),
    ("def g():\n    from .b import f\n", {"pkg.b"}),  # put off is still a circle
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import T\n", {"pkg.b"}),  # types count too
    ("from . import b\n", {"pkg.b"}),
])
def test_the_reader_sees_each_kind_of_import(tmp_path: pathlib.Path, source: str, expected: set[str]) -> None:
    (tmp_path / "a.py").write_text(source)
    modules = {"pkg": tmp_path / "__init__.py", "pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    assert _imported("pkg.a", modules["pkg.a"], modules) == expected
    assert _circles({"pkg.a": expected, "pkg.b": {"pkg.a"}, "pkg": set()}) == ([["pkg.a", "pkg.b"]] if expected
                                                                              else [])


def test_the_layer_reader_takes_the_longest_entry() -> None:
    layers = (("pkg.low",), ("pkg.mid", "pkg.low.up"), ("pkg",))
    assert [_layer_of(m, layers) for m in ("pkg.low", "pkg.low.x", "pkg.low.up.y", "pkg.mid", "pkg", "pkg.other")] \
        == [0, 0, 1, 1, 2, None]


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
