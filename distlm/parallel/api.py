"""Apply parallelism to a single-device model from outside, in one fixed order.

The order is: tensor parallel, then activation checkpointing, then compile, then FSDP
or DDP with its communication hook. Only DDP exists so far; each later strategy is one
more ``apply_*`` call in this sequence, never a change to the model code.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from distlm.config import DistributedConfig
from distlm.mesh import ParallelDims
from distlm.parallel.ddp import apply_ddp

logger = logging.getLogger("distlm")


def parallelize(
    model: torch.nn.Module,
    dims: ParallelDims,
    cfg: DistributedConfig,
    device: torch.device,
    comm_hook: tuple[Callable, Any] | None = None,
) -> torch.nn.Module:
    if dims.dp_enabled and cfg.strategy == "ddp":
        model = apply_ddp(model, device, dims.dp_group(device.type), cfg.bucket_cap_mb, comm_hook)
        logger.info(
            "applied DDP over %d replicas, bucket_cap_mb=%g, comm hook %s%s%s",
            dims.dp, cfg.bucket_cap_mb, cfg.comm_hook,
            " over mpi4py" if cfg.comm_transport == "mpi" else "",
            " with double buffering (gradients one update stale)" if cfg.double_buffering else "",
        )
    return model


def build_comm_hook(
    cfg: DistributedConfig, dims: ParallelDims, ranks_per_node: int, device_type: str
) -> tuple[Callable, Any] | None:
    """The DDP communication hook for --comm-hook/--comm-transport/--double-buffering, or None.

    None means DDP's built-in C++ all-reduce, which is exactly ``allreduce`` over the
    process group; every other choice is a Python hook from parallel/comm_hooks.py.
    """
    if cfg.comm_hook == "allreduce" and cfg.comm_transport == "torch" and not cfg.double_buffering:
        return None
    from distlm.parallel import comm_hooks
    transport_factory = None
    if cfg.comm_transport == "mpi":
        from distlm.parallel.mpi_transport import mpi_transport_factory

        transport_factory = mpi_transport_factory(device_type)
    reducer = comm_hooks.build_reducer(
        cfg.comm_hook,
        dims.dp_group(device_type),
        ranks_per_node=ranks_per_node,
        device_type=device_type,
        inter_transport_factory=transport_factory,
    )
    if cfg.double_buffering:
        return comm_hooks.double_buffered_hook(reducer)
    return comm_hooks.ddp_hook(reducer), None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's single-device module inside any wrappers (names in checkpoints stay stable)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        else:
            return model
