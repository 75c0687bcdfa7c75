"""Data parallel through torch's DistributedDataParallel, and its communication hooks.

DDP already does what distlm needs: gradients are packed into buckets of
``bucket_cap_mb`` and each full bucket is all-reduced while backward keeps computing
the rest. This module builds, registers and owns the hook that replaces that all-reduce
(a reducer of parallel/comm_hooks.py, optionally double-buffered) and its state.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from distlm.layout import Layout
from distlm.mesh import ParallelDims
from distlm.parallel.comm_hooks import Reducer, build_reducer, completed
from distlm.parallel.mpi_transport import mpi_transport_factory


def apply_ddp(
    model: torch.nn.Module,
    device: torch.device,
    process_group: dist.ProcessGroup | None,
    bucket_cap_mb: float,
    comm_hook: Callable | None = None,
    hook_state: Any = None,
) -> DistributedDataParallel:
    """torch DDP; ``comm_hook(hook_state, bucket)`` replaces DDP's own all-reduce when given."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        # Gradients live inside the communication buckets: no copy in, no copy out.
        gradient_as_bucket_view=True,
        **_no_buffer_sync_per_forward(),
    )
    if comm_hook is not None:
        ddp.register_comm_hook(hook_state, comm_hook)
    return ddp


def build_comm_hook(
    layout: Layout, dims: ParallelDims, dp_group: dist.ProcessGroup | None, device_type: str
) -> tuple[Callable | None, DoubleBufferState | None]:
    """The DDP communication hook of ``layout``'s ``--comm-hook`` over its ``--comm-transport``,
    and the double-buffering state if any; call it on every rank together. A hierarchical hook
    reduces over the node axis of ``dims``.

    ``(None, None)`` means DDP's built-in C++ all-reduce, which is exactly ``allreduce``
    over the process group; every other choice is a Python hook around a reducer.
    """
    if not layout.hooks_asked:
        return None, None
    reducer = build_reducer(
        layout.comm_hook, dp_group, dims=dims, device_type=device_type,
        inter_transport_factory=mpi_transport_factory(device_type) if layout.comm_transport == "mpi" else None,
    )
    if layout.double_buffering:
        return double_buffered_hook(reducer)
    return ddp_hook(reducer), None


def ddp_hook(reducer: Reducer) -> Callable[[object, dist.GradBucket], Future[torch.Tensor]]:
    """A DDP communication hook averaging each bucket with ``reducer``.

    Register with ``model.register_comm_hook(None, ddp_hook(reducer))``. The reducer
    divides by the world size itself, as DDP's default does (a hook replaces that).
    """

    def hook(state, bucket):  # no annotations: see double_buffered_allreduce_hook
        return reducer(bucket.buffer())

    hook.__name__ = hook.__qualname__ = f"distlm_{type(reducer).__name__}_hook"
    hook.reducer = reducer  # for the log: which groups it reduces over
    return hook


class DoubleBufferState:
    """State of ``double_buffered_hook``: the in-flight reductions of the last backward.

    Stale results are kept per parameter, not per bucket index: DDP rebuilds its buckets
    after the first iteration (in the order gradients became ready), so bucket ``i`` of
    step 2 generally holds other parameters than bucket ``i`` of step 1.
    """

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer
        # id(param) -> (future of the averaged copy of its bucket, offset of param in it, numel)
        self._pending: dict[int, tuple[Future[torch.Tensor], int, int]] = {}
        # Parameters whose latest hook call returned zeros (no previous result existed).
        self._without_previous: set[int] = set()
        self._seen = False

    @property
    def first_step(self) -> bool:
        """True when the latest backward delivered zeros for some parameter, having no
        previous step's result for it: after the very first backward (and before any).
        The trainer skips (and logs) that update."""
        return not self.has_stale_gradients()

    def has_stale_gradients(self) -> bool:
        """True when the latest backward delivered, for every parameter, the averaged
        gradient of the backward before it: the update may be applied."""
        return self._seen and not self._without_previous

    def wait_pending(self) -> None:
        """Wait for the reductions still in flight (before a checkpoint or at the end, so no
        collective is left running). Their results stay pending for the next step."""
        for future in {id(f): f for f, _, _ in self._pending.values()}.values():
            future.wait()

    def hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        buffer = bucket.buffer()
        base = buffer.data_ptr()
        itemsize = buffer.element_size()
        # (param id, offset, numel) in this bucket's layout; gradients() are views of the buffer.
        layout = [
            (id(param), (grad.data_ptr() - base) // itemsize, grad.numel())
            for param, grad in zip(bucket.parameters(), bucket.gradients())
        ]
        previous = [self._pending.get(key) for key, _, _ in layout]

        # DDP reuses the bucket buffer for the next backward: reduce a copy of it, issued now.
        future = self.reducer(buffer.clone())
        for key, offset, numel in layout:
            self._pending[key] = (future, offset, numel)

        self._seen = True
        stale = torch.zeros_like(buffer)
        for (key, offset, numel), entry in zip(layout, previous):
            if entry is None:
                self._without_previous.add(key)
                continue
            self._without_previous.discard(key)
            old_future, old_offset, old_numel = entry
            assert old_numel == numel, "a parameter changed size between steps"
            stale[offset : offset + numel].copy_(old_future.wait()[old_offset : old_offset + numel])
        return completed(stale)


def double_buffered_allreduce_hook(state, bucket):
    """DDP hook: issue this step's reduction of ``bucket`` and return the previous step's.

    ``state`` is a ``DoubleBufferState``, ``bucket`` a ``dist.GradBucket``. Hooks carry no
    annotations: DDP compares them with the real classes, and this module's postponed
    (string) annotations would fail that check."""
    return state.hook(bucket)


def double_buffered_hook(reducer: Reducer) -> tuple[Callable[..., Future[torch.Tensor]], DoubleBufferState]:
    """ChainerMN double buffering around any reducer: ``(hook, state)`` for
    ``model.register_comm_hook(state, hook)``.

    The update of step t applies the averaged gradients of step t-1 while step t's
    reduction runs in the background (one step of staleness). After the first backward
    every gradient is zero and ``state.first_step`` is True: skip that update, since
    weight decay or momentum would still move the weights. Costs one extra copy of the
    gradients (the copy being reduced) plus the zero-filled result per bucket.
    """
    state = DoubleBufferState(reducer)
    return double_buffered_allreduce_hook, state


def _no_buffer_sync_per_forward() -> dict[str, bool]:
    """distlm models keep no state in buffers that training changes (rotary tables are
    constants), so broadcasting buffers before every forward would be pure overhead.
    torch 2.13 renamed the switch; older releases (Neuron's torch-xla stacks) know the old name."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
