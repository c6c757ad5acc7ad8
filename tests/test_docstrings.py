"""Every public call has a docstring for users (issue 53): a one-line summary, then the sections Args (where it
takes arguments), Returns, Raises, Communication, Device and memory, and Example (Google style, which the API
reference renders). The calls are every function in ``zero_dtensor.__all__``, the public methods of the families
and handles it exports, and the classes a user constructs."""

from __future__ import annotations

import inspect
import re

import pytest

import zero_dtensor as zd

SECTIONS = ("Returns:", "Raises:", "Communication:", "Device and memory:", "Example:")
#: exported classes whose methods are user calls (exceptions, layouts and value records have none)
FRONTS = ("ShardedTensors", "ShardedGrads", "ShardedMasterParams", "ShardedOptimizerState", "ParamView",
          "ParamGrad", "GradHookHandle", "KeepFullGradsHandle", "GradStatsLogger", "RankPool")
#: exported classes a user constructs: their class docstring documents the constructor
CONSTRUCTED = ("GradStatsLogger", "RankPool")


def _public_calls() -> dict[str, object]:
    calls: dict[str, object] = {}
    seen: set[int] = set()  # a method inherited by several fronts is one call, named after the first front
    for name in zd.__all__:
        obj = getattr(zd, name)
        if inspect.isfunction(obj):
            calls[f"zd.{name}"] = obj
    for cls_name in FRONTS:
        cls = getattr(zd, cls_name)
        for klass in cls.__mro__:
            if not klass.__module__.startswith("zero_dtensor"):
                continue
            for attr, value in vars(klass).items():
                if not attr.startswith("_") and inspect.isfunction(value) and id(value) not in seen:
                    seen.add(id(value))
                    calls[f"{cls.__name__}.{attr}"] = value
    for cls_name in CONSTRUCTED:
        calls[f"zd.{cls_name}"] = getattr(zd, cls_name)
    try:
        from zero_dtensor.lightning import ZeroGradCallback
    except ImportError:  # the lightning extra; CI installs it with .[test]
        pass
    else:
        calls["ZeroGradCallback"] = ZeroGradCallback
    return calls


CALLS = _public_calls()


def _takes_arguments(obj: object) -> bool:
    target = obj.__init__ if inspect.isclass(obj) else obj
    return any(p.name not in ("self", "cls") for p in inspect.signature(target).parameters.values())


def test_the_list_of_calls_is_the_public_api() -> None:
    assert len(CALLS) >= 60
    for expected in ("zd.sharded_grads", "zd.save", "zd.load", "ShardedTensors.full_tensors", "ShardedTensors.norms",
                     "ShardedTensors.clip_grad_norm_", "ShardedTensors.map_full_", "ParamView.to_local",
                     "ShardedMasterParams.mark_written", "GradHookHandle.remove"):
        assert expected in CALLS


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_public_call_has_the_user_sections(name: str) -> None:
    doc = inspect.getdoc(CALLS[name]) or ""
    lines = doc.splitlines()
    assert lines and lines[0].strip() and (len(lines) == 1 or not lines[1].strip()), \
        f"{name}: the docstring starts with a one-line summary and a blank line"
    wanted = (("Args:",) if _takes_arguments(CALLS[name]) else ()) + SECTIONS
    missing = [s for s in wanted if not re.search(rf"^{re.escape(s)}\s*$", doc, flags=re.M)
               and not (s == "Raises:" and re.search(r"^Raises nothing\.$", doc, flags=re.M))]
    assert not missing, f"{name}: the docstring has no section {missing}"
    example = doc.split("Example:", 1)[1]
    assert "```python" in example, f"{name}: the Example shows code"


def test_long_docstrings_shrank() -> None:
    """What a user needs fits in a screen; the internals live in docs/design.md."""
    sizes = {n: len(inspect.getdoc(CALLS[n])) for n in ("zd.save", "zd.load", "ShardedTensors.full_tensors")}
    assert all(size < 2500 for size in sizes.values()), sizes
