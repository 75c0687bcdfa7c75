"""Per-rank memory held in parameters, gradients and optimizer state, measured.

The bytes are read from the tensors this rank actually holds: the local shard of a
DTensor, each storage counted once. So tied weights count once, DDP's gradients
(views into its communication buckets) count as the buckets, and FSDP's shards count
with the padding FSDP adds to a dimension the data-parallel degree does not divide.
The ZeRO paper's formulas are in ``zero_formula_bytes`` for comparison, never used
for the measurement itself.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from distlm.precision import MODE_DTYPES
from distlm.state.names import local_shard


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """``{"param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes"}`` on this rank.

    Gradients count only while they exist: call it after backward (or after the
    optimizer step) and before ``zero_grad(set_to_none=True)``.
    """
    params = list(model.parameters())
    param_bytes = _storage_bytes(params)
    grad_bytes = _storage_bytes(p.grad for p in params if p.grad is not None)
    optimizer_bytes = optimizer_state_bytes(optimizer) if optimizer is not None else 0
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": optimizer_bytes,
        "total_bytes": param_bytes + grad_bytes + optimizer_bytes,
    }


ZERO_STAGES: dict[str, int] = {"ddp": 0, "zero1": 1, "fsdp": 3}
"""Each data-parallel strategy (choices.STRATEGIES) as the ZeRO stage whose memory it has."""


def zero_formula_bytes(num_params: int, dp: int, stage: int, optimizer_bytes_per_param: int = 8,
                       precision: str = "fp32") -> dict[str, float]:
    """The ZeRO paper's per-rank bytes for ``num_params`` (Ψ) parameters over ``dp`` ranks: weights
    and gradients in the weights' dtype of ``precision`` (4 + 4 bytes, fp32 also under bf16 and
    fp16 autocast; 2 + 2 with --memory-efficient-fp16) and Adam's two fp32 moments (8 bytes).

    Stage 0 is DDP (16Ψ in fp32), 1 shards the optimizer state (8Ψ/N of it), 2 also the
    gradients, 3 (FSDP) everything: 16Ψ/N in fp32.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    weight_bytes = MODE_DTYPES[precision].param.itemsize
    params = weight_bytes * num_params / (dp if stage >= 3 else 1)
    grads = weight_bytes * num_params / (dp if stage >= 2 else 1)
    optimizer = optimizer_bytes_per_param * num_params / (dp if stage >= 1 else 1)
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optimizer, "total_bytes": params + grads + optimizer}



def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (their local shards)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = local_shard(tensor).untyped_storage()
        if storage.device.type == "meta" or storage.nbytes() == 0:
            continue
        # The storage object's own address: shared by every view and alias of one
        # storage, and defined on every device (an XLA storage has no data pointer).
        key = storage._cdata
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (local shards of DTensor moments)."""
    return _storage_bytes(_optimizer_tensors(optimizer))


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    # ZeroRedundancyOptimizer keeps this rank's shard of the state in its inner
    # optimizer (``.optim``); read it there, whatever the wrapper's own ``state`` holds.
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
