"""Data parallel through torch's DistributedDataParallel.

DDP already does what distlm needs: gradients are packed into buckets of
``bucket_cap_mb`` and each full bucket is all-reduced while backward keeps computing
the rest. This module is the single place where communication hooks are registered.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


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


def _no_buffer_sync_per_forward() -> dict[str, bool]:
    """distlm models keep no state in buffers that training changes (rotary tables are
    constants), so broadcasting buffers before every forward would be pure overhead.
    torch 2.13 renamed the switch; older releases (Neuron's torch-xla stacks) know the old name."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
