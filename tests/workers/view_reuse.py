"""Issue 11, worker side: views made once and reused across calls and steps, never over memory still in use."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable

import pytest
import torch
from deepspeed.utils import safe_get_full_grad

import zero_dtensor as zd
from zero_dtensor.ops import writes
from zero_dtensor.materialize import BUFFERS, release_workspace
from zero_dtensor.materialize.placements import assembly_of
from zero_dtensor.layout.views import storage_refs

from .common import EngineCase, build_engine, fill_value, forward_backward, params_snapshot
from .dispatch_probe import DispatchProbe


def _in_place(grads: zd.ShardedGrads, pieces) -> bool:
    """Whether the first group's partition is the memory of DeepSpeed's ``pieces`` (used in place, not copied)."""
    return grads.local_partitions[0].untyped_storage().data_ptr() == pieces[0].untyped_storage().data_ptr()


def _reference(engine) -> dict[str, torch.Tensor]:
    return {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}


def check_partition_reuse(case: EngineCase) -> dict[str, bool]:
    """Over four steps: every read equals DeepSpeed's; where the adapter copies DeepSpeed's pieces into a flat
    partition (ZeRO-1/2 without offload), a fragment a caller still holds from an earlier step keeps that step's
    values (its memory is not reused); once nothing is held, later steps reuse the same memory."""
    engine = build_engine(case)
    copied = case.stage in (1, 2) and not case.offload and not case.bf16_optimizer
    held, held_values, pointers, firsts = None, None, [], []
    for step in range(4):
        forward_backward(engine, step)
        pieces = engine.optimizer.averaged_gradients.get(0) if copied else None
        with DispatchProbe() as probe:
            grads = zd.sharded_grads(engine)
        counts = probe.summary()
        in_place = pieces is not None and _in_place(grads, pieces)
        firsts.append({"ops": counts["ops"], "written": counts["written"], "allocated": counts["allocated"],
                       "in_place": in_place})
        expected = _reference(engine)
        full = grads.full_tensors()
        for name, value in expected.items():
            assert torch.equal(full[name], value), (step, name)
        pointers.append(grads.local_partitions[0].data_ptr())
        rebound = pieces and engine.optimizer.averaged_gradients.get(0)
        if step == 3 and in_place and hasattr(rebound, "move_flat_partition"):
            # GradPartitionBufferGroup's _view_specs (read by its move_flat_partition, after it moved the partition):
            # what its __init__ computes, relative to the partition as it lay before the move
            flat = rebound.flat_partition
            want = [(b.storage_offset() - flat.storage_offset(), b.shape, getattr(b, "_zero_padding", False))
                    for b in rebound]
            flat.data = flat.data.clone()  # as a move to another device leaves it (same values)
            assert rebound._view_specs == want, step
        if step == 1:  # hold a live view into the next step: its memory must not be handed out again meanwhile
            held_name = next(n for n in grads.names if grads[n].local_range[1] > grads[n].local_range[0])
            held = grads[held_name].to_local()
            held_values = held.clone()
        if step == 2:
            now = grads[held_name].to_local()
            if copied:  # the adapter's own copy: a held view keeps its step's values, new memory was used
                assert torch.equal(held, held_values), "memory a caller still holds was reused"
                assert held.data_ptr() != now.data_ptr()
            else:  # DeepSpeed's persistent buffer: a live view follows it, as DeepSpeed's own memory does
                assert held.data_ptr() == now.data_ptr() and torch.equal(held, now)
            held = held_values = None
        del full, grads
        engine.step()
    return {"reused": pointers[3] in pointers[:3], "firsts": firsts}


def check_replaced_pieces_freed_by_the_step(case: EngineCase) -> None:
    """ZeRO-1/2: the list of pieces DeepSpeed made in backward, which ``sharded_grads`` replaces with views of its
    flat partition, lives until DeepSpeed's step drops it (freed there, as without zero_dtensor), not longer; a
    second call in the same step finds the rebound list current, and the step makes its views stale. Nor does a
    partition used in place (ZeRO-1, a rank whose pieces lie in flat order in one buffer) keep the tensor its
    first piece is a view of (a parameter's gradient) alive past the step while the caller holds the gradients:
    an ``as_strided`` of the piece itself had it as its ``_base`` (kept after the step, and after the gradients
    were dropped)."""
    engine = build_engine(case)
    opt = engine.optimizer
    for step in range(3):
        forward_backward(engine, step)
        first = opt.averaged_gradients[0][0]
        piece = weakref.ref(first)
        underlying = weakref.ref(first if first._base is None else first._base)
        del first
        grads = zd.sharded_grads(engine)
        assert piece() is not None and underlying() is not None, "DeepSpeed's pieces were freed before its step"
        again = zd.sharded_grads(engine)
        assert again.local_partitions[0].data_ptr() == grads.local_partitions[0].data_ptr()
        assert torch.equal(again.full_tensors()[grads.names[0]], grads.full_tensors()[grads.names[0]])
        del again
        engine.step()
        assert piece() is None, "DeepSpeed's replaced pieces outlived its step"
        assert underlying() is None, "the tensor DeepSpeed's first piece views outlived its step"
        with pytest.raises(zd.StaleGradientsError):
            grads.norms()
        del grads


def _fresh_pool() -> None:
    """Forget the buffers earlier tests in this worker left in the pool: one of them, freed late (a result caught in
    a reference cycle until the collector ran), would be found idle first and handed out instead of this test's."""
    gc.collect()
    release_workspace()


def _free_pointers() -> set[int]:
    """Storage addresses of the recycled buffers nothing outside the pool reaches."""
    return {c.buffer.untyped_storage().data_ptr() for kept in BUFFERS._recycled.values() for c in kept
            if c.is_idle(check_objects=True)}


def _tensors_released() -> bool:
    """Whether no tensor outside the pool refers to any recycled buffer (storage objects held by the caller
    aside)."""
    return all(storage_refs(c.buffer) == c._base_refs + c._held and c.views_free()
               for kept in BUFFERS._recycled.values() for c in kept)


def _wait_released(timeout: float = 10.0, idle: Callable[[], bool] = BUFFERS.idle) -> None:
    """Until every recycled buffer is free (``idle``): a synchronous gloo collective returns once its work
    completed, and the backend's worker thread drops its reference to the buffers a moment later (on a busy
    machine, later than the pool's own short wait). The pool must then recycle; this makes the moment
    deterministic, not the check."""
    deadline = time.monotonic() + timeout
    while not idle():
        assert time.monotonic() < deadline, "the backend never let go of a dropped result's buffer"
        time.sleep(0.001)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).clone()


def check_held_storage_not_reused(case: EngineCase) -> None:
    """A result held only through its storage object (``t.untyped_storage()``) is never overwritten by later calls;
    once that is dropped too, its buffer is recycled."""
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    _fresh_pool()
    first = grads.full_tensors()
    name = grads.names[0]
    storage = first[name].untyped_storage()
    held = _bytes_of(storage)
    pointer = storage.data_ptr()
    del first
    _wait_released(idle=_tensors_released)  # only the storage object holds the first buffer now
    grads.mul_(3.0)  # the next gather writes other values
    second = grads.full_tensors()
    assert torch.equal(_bytes_of(storage), held), "memory the caller still holds (through its storage) was overwritten"
    assert all(t.untyped_storage().data_ptr() != pointer for t in second.values())
    del storage  # ``second`` stays alive: its buffer is busy, the first one is free now
    _wait_released(idle=lambda: _free_pointers() >= {pointer})
    third = grads.full_tensors()
    assert any(t.untyped_storage().data_ptr() == pointer for t in third.values()), "a free buffer was not reused"
    del second, third


def check_late_freed_result_not_preferred(case: EngineCase) -> None:
    """An older result freed late (caught in a reference cycle until the collector runs) does not displace the
    result the caller just dropped: the next call hands out the dropped result's buffer and view objects."""
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    _fresh_pool()
    gc.disable()
    try:
        older = grads.full_tensors()
        cycle: list = [older]
        cycle.append(cycle)
        del older, cycle
        first = grads.full_tensors()  # the second kept buffer
        ids = {n: id(t) for n, t in first.items()}
        del first
        gc.collect()  # the older result's buffer is free now too, and kept first
        _wait_released()
        second = grads.full_tensors()
    finally:
        gc.enable()
    assert all(id(t) == ids[n] for n, t in second.items()), "a late-freed older buffer was handed out instead"


def check_result_views_reused(case: EngineCase) -> None:
    """A dropped full_tensors() result's tensors come back (the same objects) from the next call, with the new
    values; a result (or a single tensor of one) still referenced is never overwritten."""
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    _fresh_pool()
    first = grads.full_tensors()
    ids = {n: id(t) for n, t in first.items()}
    del first
    _wait_released()
    second = grads.full_tensors()
    assert all(id(t) == ids[n] for n, t in second.items()), "cut views were made again for a recycled buffer"
    kept_name = grads.names[0]
    kept = second[kept_name]
    snapshot = kept.clone()
    del second
    grads.mul_(2.0)
    third = grads.full_tensors()
    assert torch.equal(kept, snapshot), "a tensor the caller still holds was overwritten"
    assert third[kept_name] is not kept
    assert torch.equal(third[kept_name], 2 * snapshot)
    # out= the previous result: same objects, new values, no per-tensor check needed
    again = grads.full_tensors(out=third)
    assert again is third and all(again[n] is third[n] for n in third)
    # a replaced entry is checked again
    third[kept_name] = torch.zeros(3)
    try:
        grads.full_tensors(out=third)
    except ValueError as e:
        assert kept_name in str(e)
    else:
        raise AssertionError("a wrong out= entry was accepted")


def check_write_paths(case: EngineCase, max_classes: int) -> dict[str, bool]:
    """set_full_ through the staged row copy and through per-parameter views write the same values."""
    writes.MAX_SHAPE_CLASSES = max_classes
    writes._ROW_WRITES.clear()
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    values = {n: fill_value(n, grads[n].shape) for n in grads.names}
    subset = {n: values[n] for n in reversed(grads.names[1::2])}  # not in model order, not every parameter
    scale = grads.loss_scale

    def expected(name: str, value: torch.Tensor) -> torch.Tensor:  # stored = value × scale in the stored dtype
        return (value.float() * scale).to(grads[name].dtype).float() / scale if scale != 1.0 else value

    grads.set_full_(subset)
    full = grads.full_tensors()
    for name, value in subset.items():
        assert torch.equal(full[name], expected(name, value).to(full[name].dtype)), name
    grads.set_full_(values)
    staged = any(w is not None for w in writes._ROW_WRITES.values())
    full = grads.full_tensors()
    for name, value in values.items():
        assert torch.equal(full[name], expected(name, value).to(full[name].dtype)), name
    del full
    again = {n: -2 * v for n, v in values.items()}  # the accepted request's names, shapes and dtypes: the fast check
    grads.set_full_(again)
    full = grads.full_tensors()
    for name, value in again.items():
        assert torch.equal(full[name], expected(name, value).to(full[name].dtype)), name
    return {"staged": staged}


def check_row_reorder(case: EngineCase) -> dict[str, bool]:
    """ZeRO-3 with sizes that share a wide width: full_tensors by all_gather (the row reorder), by all_reduce (the
    row fill) and by all_to_all and send_recv (this rank's rows and the received ones, each by its row copy) equal
    DeepSpeed's ``safe_get_full_grad``, twice (recycled buffers), and after a write (also into ``out=``)."""
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    expected = _reference(engine)
    plans = grads._state.plan.groups
    for strategy in ("all_gather", "all_reduce", "all_to_all", "send_recv", "all_gather", "all_to_all", "send_recv"):
        full = grads.full_tensors(strategy=strategy)
        for name, value in expected.items():
            assert torch.equal(full[name], value.to(full[name].dtype)), (strategy, name)
        del full
    values = {n: fill_value(n, grads[n].shape) for n in grads.names}
    grads.set_full_(values)
    for strategy in ("all_gather", "all_reduce", "all_to_all", "send_recv"):
        full = grads.full_tensors(strategy=strategy)
        for name, value in values.items():
            assert torch.equal(full[name], value.to(full[name].dtype)), (strategy, name)
        again = grads.full_tensors(out=full, strategy=strategy)
        for name, value in values.items():
            assert torch.equal(again[name], value.to(again[name].dtype)), (strategy, "out=", name)
    esize = grads.local_partitions[0].element_size()
    return {"rows": all(p.column_rows(esize) is not None and p.own_column_rows(esize) is not None for p in plans),
            "peer_rows": all(assembly_of(p.group).peer_rows(p, esize) is not None for p in plans)}


def check_ordered_buffer_trains_alike(case: EngineCase) -> list[bool]:
    """Issue 42: DeepSpeed's gradient buffer laid out in flat order (``_deepspeed/grad_order.py``, from the first
    ``sharded_grads`` on) changes where the values lie, not what DeepSpeed computes. Over four steps (of
    ``case.gas`` micro-steps), an engine read through zero_dtensor every step (each read equal to
    ``safe_get_full_grad``) has bitwise the parameters of a twin engine that DeepSpeed trains alone. The library's
    flat copy of the first step is freed once the pieces are used in place. Returns, per
    step, whether the partition was DeepSpeed's own memory (used in place)."""
    ours, theirs = build_engine(case), build_engine(case)
    in_place, copies = [], []
    for step in range(4):
        for engine in (ours, theirs):
            for micro in range(case.gas):
                forward_backward(engine, step * case.gas + micro)
                if micro < case.gas - 1:
                    engine.step()
        pieces = ours.optimizer.averaged_gradients.get(0)
        grads = zd.sharded_grads(ours)
        in_place.append(_in_place(grads, pieces))
        if not in_place[-1]:  # the library's flat copy (the first step): not kept once the pieces are used in place
            copies.append(weakref.ref(grads.local_partitions[0].untyped_storage()))
        elif copies:
            gc.collect()
            assert all(copy() is None for copy in copies), f"step {step}: an unused flat copy is still allocated"
        full = grads.full_tensors()
        # DeepSpeed's safe_get_full_grad is wrong under round_robin_gradients (its _hp_mapping; test_configs checks
        # those reads against a single-process reference); its values are scaled under fp16 (by 2^k: exact)
        refs = {} if dict(case.zero).get("round_robin_gradients") else _reference(ours)
        for name, value in refs.items():
            assert torch.equal(full[name].float(), value.float() / grads.loss_scale), (step, name)
        del grads, full, pieces
        ours.step()
        theirs.step()
        mine, reference = params_snapshot(ours), params_snapshot(theirs)
        for name in mine:
            assert torch.equal(mine[name], reference[name]), (step, name)
    return in_place


def check_empty_results_keep_their_dtype(case: EngineCase) -> dict:
    """A rank whose share of a redistribution is empty (``to_dtensors`` of two one-row parameters: the last rank
    holds no row) gets results of the family's own dtype, read after a family of another dtype left an empty
    buffer of its own in the pool: every empty buffer has address 0, and the pool once took one for another (the
    bf16 gradients came back as float32 on that rank, and the next collective hung). Values against
    ``full_tensors()``."""
    engine = build_engine(case)
    forward_backward(engine)
    grads, master = zd.sharded_grads(engine), zd.sharded_master_params(engine)
    _fresh_pool()
    names = ["tiny.weight", "tiny.bias"]
    first = grads.to_dtensors(names)
    del first
    masters = master.to_dtensors(names)
    again = grads.to_dtensors(names)
    full = grads.full_tensors(names)
    local = {}
    for n in names:
        assert again[n].dtype == grads[n].dtype == again[n].to_local().dtype, (n, again[n].to_local().dtype)
        assert masters[n].to_local().dtype == torch.float32, (n, masters[n].to_local().dtype)
        assert torch.equal(again[n].full_tensor(), full[n]), n
        local[n] = again[n].to_local().numel()
    return local
