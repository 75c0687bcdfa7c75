"""Apply parallelism to a single-device model from outside, in one fixed order.

The order is: tensor parallel, then activation checkpointing, then compile, then FSDP
or DDP with its communication hook. Only DDP exists so far; each later strategy is one
more ``apply_*`` call in this sequence, never a change to the model code.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from distlm.config import DistributedConfig
from distlm.mesh import ParallelDims
from distlm.parallel.ddp import apply_ddp

logger = logging.getLogger("distlm")


def parallelize(
    model: torch.nn.Module, dims: ParallelDims, cfg: DistributedConfig, device: torch.device
) -> torch.nn.Module:
    if dims.dp_enabled and cfg.strategy == "ddp":
        model = apply_ddp(model, device, dims.dp_group(device.type), cfg.bucket_cap_mb)
        logger.info("applied DDP over %d replicas, bucket_cap_mb=%g", dims.dp, cfg.bucket_cap_mb)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's single-device module inside any wrappers (names in checkpoints stay stable)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        else:
            return model
