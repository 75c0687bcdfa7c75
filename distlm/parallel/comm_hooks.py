"""Gradient-reduction algorithms for DDP's communication hooks (ChainerMN's leaf communicators).

* a **transport** does one flat in-place all-reduce (sum) over one group:
  ``TorchTransport`` (gloo on CPU, NCCL on CUDA); an MPI one plugs in with the same members;
* a **reducer** ``reduce(flat) -> Future[flat averaged over the data-parallel ranks]`` is one
  algorithm: plain, half precision, hierarchical (optionally half precision between nodes).

parallel/ddp.py wraps a reducer into DDP's hook (optionally double-buffered) and registers it.

Every collective is issued in the reducer's body, never inside a ``Future.then`` callback:
on gloo, collectives issued from callbacks fail at random ("Received data size doesn't match
expected size"). Where one leg needs the previous leg's result, the body waits for it; only
pure computation (cast back, copy out) runs in callbacks.

Process groups are arguments; nothing here lives in module globals.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch.futures import Future

from distlm.choices import COMM_HOOK_KINDS, COMM_HOOKS
from distlm.errors import UsageError
from distlm.mesh import ParallelDims
from distlm.precision import DTYPES, dtype_name
from distlm.runtime.context import all_gather_tensor

Reducer = Callable[[torch.Tensor], "Future[torch.Tensor]"]


# ---------------------------------------------------------------------------------------
# Transports
# ---------------------------------------------------------------------------------------


class Transport(Protocol):
    """One flat all-reduce leg over one group."""

    size: int
    """Number of ranks in the group."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        """Sum ``tensor`` in place over the group; the future resolves to ``tensor`` itself.

        The collective is started (or queued, for MPI's communication thread) before this
        returns, in call order, so every rank runs the same sequence of collectives."""
        ...


class TorchTransport:
    """torch.distributed over ``group`` (``None``: the world): gloo on CPU, NCCL on CUDA."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _then(work.get_future(), lambda: tensor)

    def __repr__(self) -> str:
        return f"TorchTransport(size={self.size})"


def _then(future: Future, fn: Callable[[], torch.Tensor]) -> Future[torch.Tensor]:
    """``future.then`` for pure computation; a failed collective re-raises instead of being dropped."""

    def callback(done: Future) -> torch.Tensor:
        done.value()  # raises the collective's error, if any
        return fn()

    return future.then(callback)


def completed(tensor: torch.Tensor) -> Future[torch.Tensor]:
    future: Future[torch.Tensor] = Future()
    future.set_result(tensor)
    return future


def _half_sum(transport: Transport, tensor: torch.Tensor, dtype: torch.dtype) -> Future[torch.Tensor]:
    """All-reduce ``tensor`` (already divided by the world size) in ``dtype``, cast back into it."""
    if tensor.dtype == dtype:
        return transport.all_reduce_sum(tensor)
    half = tensor.to(dtype)
    return _then(transport.all_reduce_sum(half), lambda: tensor.copy_(half))


# torch 2.13 renamed it (the old name warns); older releases (Neuron's torch-xla stacks)
# know only the old one. Same arguments. (all_gather_tensor: the same for the all-gather.)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_half_dtype(dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise ValueError(f"reduction dtype must be floating point, got {dtype}")


# ---------------------------------------------------------------------------------------
# Reducers: reduce(flat) -> Future of the data-parallel mean of flat (same shape and dtype)
# ---------------------------------------------------------------------------------------


class AllReduceReducer:
    """Divide by the group size, then one all-reduce (sum): what DDP does by default."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def __call__(self, flat: torch.Tensor) -> Future[torch.Tensor]:
        flat.div_(self.transport.size)
        return self.transport.all_reduce_sum(flat)

    def __repr__(self) -> str:
        return f"allreduce over {self.transport.size} ranks"


class HalfPrecisionReducer:
    """All-reduce in fp16 or bf16: half the bytes on the wire, the result cast back into ``flat``.

    Works on gloo (torch's stock ``bf16_compress_hook`` refuses to run without NCCL). Each
    rank divides by the world size n before casting, so no partial sum exceeds the largest
    rank's gradient: fp16 cannot overflow while every gradient fits in fp16, and the error
    is at most ``(n / 2) * eps * max|g|``. The price is fp16's subnormal range: values below
    ``n * 6.1e-5`` lose relative accuracy (loss scaling keeps gradients above it). The
    bounds are derived in benchmarks/README.md.
    """

    def __init__(self, transport: Transport, dtype: torch.dtype) -> None:
        _check_half_dtype(dtype)
        self.transport = transport
        self.dtype = dtype

    def __call__(self, flat: torch.Tensor) -> Future[torch.Tensor]:
        flat.div_(self.transport.size)
        return _half_sum(self.transport, flat, self.dtype)

    def __repr__(self) -> str:
        return f"{dtype_name(self.dtype)} allreduce over {self.transport.size} ranks"


class HierarchicalReducer:
    """ChainerMN's hierarchical communicator, in three legs issued one after the other:

    1. reduce-scatter the (padded) flat buffer inside the node: each local rank gets the
       node's sum of one 1/L shard;
    2. all-reduce that shard across nodes among the ranks with the same local rank, through
       ``inter_transport``, optionally in ``half_dtype`` (``hierarchical-fp16``: only this
       leg, where bandwidth is scarce, is in half precision; the intra-node legs stay fp32);
    3. all-gather the shards inside the node and drop the padding.

    The shard is divided by the world size before the inter-node leg, so with a half
    precision leg the bound of ``HalfPrecisionReducer`` holds with n the number of nodes
    and the node sums ``/ world`` as inputs: no overflow unless a node's gradient sum / L
    would, and ``|error| <= nodes * u * sum_nodes |node_sum| / world`` plus fp32 rounding.

    With one node (``inter_transport`` None or of size 1) there is nothing to arrange
    hierarchically: the node's own all-reduce is the whole algorithm, and costs what the
    flat one does. With one rank per node the intra-node legs are skipped.
    """

    def __init__(
        self,
        intra_group: dist.ProcessGroup | None,
        inter_transport: Transport | None,
        half_dtype: torch.dtype | None = None,
    ) -> None:
        if half_dtype is not None:
            _check_half_dtype(half_dtype)
        self.intra_group = intra_group
        self.local_size = dist.get_world_size(intra_group)
        self.inter = inter_transport if inter_transport is not None and inter_transport.size > 1 else None
        self.num_nodes = inter_transport.size if inter_transport is not None else 1
        self.world_size = self.local_size * self.num_nodes
        self.half_dtype = half_dtype

    def _inter_leg(self, shard: torch.Tensor) -> Future[torch.Tensor]:
        if self.inter is None:
            return completed(shard)
        if self.half_dtype is None:
            return self.inter.all_reduce_sum(shard)
        return _half_sum(self.inter, shard, self.half_dtype)

    def __call__(self, flat: torch.Tensor) -> Future[torch.Tensor]:
        if self.local_size == 1:
            flat.div_(self.world_size)
            return self._inter_leg(flat)
        if self.inter is None:
            flat.div_(self.world_size)
            return TorchTransport(self.intra_group).all_reduce_sum(flat)
        numel = flat.numel()
        shard_numel = -(-numel // self.local_size)
        if shard_numel * self.local_size == numel:
            padded = flat
        else:
            padded = flat.new_zeros(shard_numel * self.local_size)
            padded[:numel].copy_(flat)
        shard = flat.new_empty(shard_numel)
        _reduce_scatter(shard, padded, group=self.intra_group)
        shard.div_(self.world_size)
        self._inter_leg(shard).wait()
        # The all-gather writes over the padded input, which the reduce-scatter is done with.
        work = all_gather_tensor(padded, shard, group=self.intra_group, async_op=True)
        if padded is flat:
            return _then(work.get_future(), lambda: flat)
        return _then(work.get_future(), lambda: flat.copy_(padded[:numel]))

    def __repr__(self) -> str:
        inter = "" if self.half_dtype is None else f", {dtype_name(self.half_dtype)} between nodes"
        return f"hierarchical allreduce over {self.num_nodes} nodes x {self.local_size} ranks{inter}"


def allreduce_reducer(transport: Transport) -> AllReduceReducer:
    return AllReduceReducer(transport)


def half_precision_reducer(transport: Transport, dtype: torch.dtype) -> HalfPrecisionReducer:
    return HalfPrecisionReducer(transport, dtype)


def hierarchical_reducer(
    intra_group: dist.ProcessGroup | None,
    inter_transport: Transport | None,
    half_dtype: torch.dtype | None = None,
) -> HierarchicalReducer:
    return HierarchicalReducer(intra_group, inter_transport, half_dtype)


# ---------------------------------------------------------------------------------------
# The one entry point for the trainer
# ---------------------------------------------------------------------------------------


def build_reducer(
    kind: str,
    dp_group: dist.ProcessGroup | None,
    *,
    dims: ParallelDims | None = None,
    device_type: str,
    inter_transport_factory: Callable[[dist.ProcessGroup | None], Transport] | None = None,
) -> Reducer:
    """The reducer of ``--comm-hook kind`` over ``dp_group``; call it on every rank together.

    ``inter_transport_factory(group)`` makes the transport of the flat leg (allreduce, fp16,
    bf16) or of the inter-node leg (hierarchical*); default ``TorchTransport``.
    The hierarchical kinds reduce over the node axis of ``dims`` (``ParallelDims.node_groups``:
    simulated nodes of ``--ranks-per-node`` ranks, or the real ones); without ``dims`` no node
    is known, which asks for ``--ranks-per-node``.
    """
    if kind not in COMM_HOOK_KINDS:
        raise UsageError(f"--comm-hook {kind!r} is unknown; choose one of {', '.join(COMM_HOOKS)}")
    hook = COMM_HOOK_KINDS[kind]
    make_transport = inter_transport_factory or TorchTransport
    half_dtype = None if hook.wire_dtype is None else DTYPES[hook.wire_dtype]
    if not hook.hierarchical:  # one flat all-reduce, in the half type if the hook has one
        transport = make_transport(dp_group)
        return allreduce_reducer(transport) if half_dtype is None else half_precision_reducer(transport, half_dtype)

    dp_size = dist.get_world_size(dp_group)
    if dp_size != dist.get_world_size():
        raise UsageError(
            f"--comm-hook {kind} needs data parallelism over all {dist.get_world_size()} ranks, "
            f"but the data-parallel group has {dp_size}; drop --tp-degree or use --comm-hook allreduce"
        )
    intra, inter = (dims or ParallelDims(world_size=dp_size)).node_groups(device_type)
    # The inter-node group holds one rank per node: every rank agrees on its size, so
    # skipping a one-rank inter leg is uniform.
    inter_transport = make_transport(inter) if dist.get_world_size(inter) > 1 else None
    return hierarchical_reducer(intra, inter_transport, half_dtype)
