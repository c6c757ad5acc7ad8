"""Make the model's working weights equal the (cast) fp32 master weights, after a write into the masters.

A write into the masters (:func:`zero_dtensor._deepspeed.families.master_storage`) changes what the next optimizer
step starts from, but not the weights the next forward uses: DeepSpeed copies master → working weights only at the
end of its own ``step()``. :func:`sync_model_params` runs that copy now, as DeepSpeed does (DeepSpeed 0.19.8):

=====================  ======================================================  =====================================
optimizer kind         what runs                                               communication
=====================  ======================================================  =====================================
ZeRO-1/2 (offload      ``opt.update_lp_params()`` (S12:3171-3182,              one ``all_gather_into_tensor`` per
too), BF16_Optimizer   BF:592-603): each rank casts its master partition into  param group over its data-parallel
                       its slice of the flat working buffer, then the slices   group (none at world size 1), in the
                       are all-gathered into the flat buffer every parameter   working dtype: ``(N-1)/N·S`` bytes
                       views (as the optimizer step's own gather); ZeRO-1/2    received per rank (``S`` the group's
                       on gloo: the same cast, then the gather by point-to-    flat working buffer); in place. On
                       point ops (:func:`_sync_zero12_by_send_recv`; not       gloo over CPU tensors (ZeRO-1/2):
                       for CUDA working weights: gloo's isend/irecv cannot     one batch of ``2(N-1)``
                       move them, ``process_groups.comm_support``)             ``isend``/``irecv`` per param group
                                                                               instead, the same bytes
ZeRO-3 (offload too)   per sub-group ``_reassign_or_swap_out_partitioned_      the copy and release: none; then one
                       parameters(sg)`` (cast copy master → the working        ``all_gather_into_tensor`` per
                       partition every ``p.ds_tensor`` views), then            (process group, dtype) of the
                       ``_partition_all_parameters()`` (frees every gathered   *persistent* parameters
                       full parameter, which would stay stale), then           (``stage3_param_persistence_
                       ``invalidate_secondary_tensor()`` (hpZ) and the         threshold``) together, each rank's
                       persistent parameters' gather, as ``_post_step`` does   partitions back to back: ``N·ceil(
                       (S3:2835-2864, S3:3322), but all of them in one         numel/N)`` elements per parameter
                       collective (``all_gather_coalesced``, DeepSpeed's own   received; other parameters are
                       bulk gather of the forward's prefetch) where            gathered by the next forward as
                       ``_post_step``'s ``all_gather`` issues one per          usual
                       parameter (68 on the benchmark model: 0.17-0.21 s of
                       a 4-rank checkpoint load); DeepSpeed's
                       ``use_all_reduce_for_fetch_params`` makes it one
                       all_reduce
=====================  ======================================================  =====================================

It is collective on every kind (ZeRO-3: whenever a parameter is persistent): every rank of the data-parallel group
must call it, also ranks whose masters did not change. Call it between optimizer steps, outside forward and backward
(ZeRO-3 releases every gathered parameter). Memory: none beyond DeepSpeed's own (ZeRO-3's persistent parameters are
gathered again into full buffers, as after every step; during the gather also one flat buffer of their gathered
partitions, ``N·ceil(numel/N)`` elements each: persistent parameters are small by definition). Working weights equal
the master cast to the working dtype (bf16/fp16; fp32 models: equal). ZeRO-3 with NVMe parameter or optimizer
offload is refused.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedDeepSpeedError
from ..comm.point_to_point import all_gather_by_send_recv
from ..comm.process_groups import backend_of, comm_support_of, communicates, rank_in
from . import check_engine

__all__ = ["applied_steps", "sync_model_params"]


def sync_model_params(engine: Any) -> None:
    """Copy ``engine``'s fp32 master weights into the model's working weights (cast to their dtype), on every rank.
    **Collective** (see the module docstring): ZeRO-1/2 and ``BF16_Optimizer`` one all_gather per param group
    (ZeRO-1/2 on gloo: one batch of point-to-point ops per param group); ZeRO-3 one all_gather of every persistent
    parameter together (per process group and dtype)."""
    kind = check_engine(engine)
    opt = engine.optimizer
    if kind == "zero3":
        _sync_zero3(opt)
    elif kind == "zero12" and _gloo_point_to_point(opt):
        _sync_zero12_by_send_recv(opt)
    else:
        opt.update_lp_params()


def _gloo_point_to_point(opt: Any) -> bool:
    """Whether the working weights' gather goes by point-to-point ops: gloo groups whose backend can move the flat
    working buffers' device that way (:func:`~zero_dtensor.comm.process_groups.comm_support`: CPU, not CUDA)."""
    group, flat = opt.real_dp_process_group[0], opt.bit16_groups_flat[0]
    return backend_of(group) == "gloo" and comm_support_of(group, flat.device).point_to_point


def _sync_zero12_by_send_recv(opt: Any) -> None:
    """``update_lp_params`` (S12:3172-3182) with the gather by point-to-point ops: per param group the master
    partition cast into this rank's partition of the flat working buffer, then every other rank's partition received
    in place by one batch of ``isend``/``irecv`` (:func:`~zero_dtensor.comm.point_to_point.all_gather_by_send_recv`), which
    moves the same bytes as DeepSpeed's ``all_gather_into_tensor`` in 0.3-0.4 of its time on gloo (the flat buffer
    holds the partitions rank after rank, as ``all_gather_into_tensor`` leaves them)."""
    for flat, partitions, master, group in zip(opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups,
                                               opt.single_partition_of_fp32_groups, opt.real_dp_process_group):
        own = partitions[rank_in(group)]
        own.data.copy_(master.data)
        if communicates(group):
            all_gather_by_send_recv(flat, own, group)  # own already is its row of flat: nothing copied locally


def _sync_zero3(opt: Any) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if getattr(opt, "swap_optimizer", False) or any(flat is None for flat in opt.fp16_partitioned_groups_flat):
        raise UnsupportedDeepSpeedError(
            "ZeRO-3 with NVMe offload (offload_optimizer or offload_param device 'nvme') swaps masters or working "
            "partitions to files; zero_dtensor refreshes working weights only from memory"
        )
    for sub_group in range(len(opt.fp16_groups)):
        opt._reassign_or_swap_out_partitioned_parameters(sub_group)
    opt._partition_all_parameters()
    invalidate = getattr(opt, "invalidate_secondary_tensor", None)
    if invalidate is not None:  # hpZ: a secondary partition would be gathered instead of the fresh primary
        invalidate()
    released = [p for p in opt.persistent_parameters if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if released:
        released[0].all_gather_coalesced(released).wait()


def applied_steps(engine: Any) -> int:
    """How many optimizer steps ``engine`` has applied (``global_steps`` less those skipped for fp16 overflow): each
    applied step ends with DeepSpeed's own master → working-weight copy, a skipped one does not. No
    communication."""
    return int(engine.global_steps) - int(engine.skipped_steps)
