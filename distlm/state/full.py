"""Whole (unsharded) model and optimizer state under single-device names, for any strategy.

torch's state-dict API consolidates DDP, FSDP2 and DTensor tensor-parallel state and
scatters it back. distlm uses it where whole tensors are wanted by design: filling a
meta model's shards from rank 0's initialisation, and comparing trained parameters in
tests. Checkpoints are sharded instead (distlm/checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from distlm.state.names import parameter_names


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Consolidated weights on CPU under the single-device names, as tensors of their own.

    A collective under FSDP: every rank must call it. With ``rank0_only`` (the
    default) only rank 0 receives the tensors and the other ranks get ``{}``. Works for
    plain and DDP models too. Tied names keep sharing one tensor.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    live = _storages(list(model.parameters()) + list(model.buffers()))
    copies: dict[tuple, torch.Tensor] = {}
    result = {}
    for name, tensor in state.items():
        key = (tensor.device, _storage_key(tensor), tensor.storage_offset(), tensor.shape, tensor.stride())
        if key not in copies:
            copies[key] = _own_cpu_copy(tensor, live)
        result[name] = copies[key]
    return result


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, from_rank0: bool = False) -> None:
    """Inverse of ``full_state_dict``; each rank keeps only its own shard.

    By default every rank passes the full weights. With ``from_rank0`` only rank 0
    does, the others pass ``{}`` and rank 0's tensors are broadcast one at a time
    (collective).
    """
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
    set_model_state_dict(model, dict(state_dict), options=options)


def consolidated_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, under its single-device name, on every rank (collective)."""
    names = set(parameter_names(model))
    return {name: tensor for name, tensor in full_state_dict(model, rank0_only=False).items() if name in names}


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage, shared by its views; ``data_ptr`` would do on
    CPU and CUDA, but XLA storages have no data pointer."""
    return tensor.untyped_storage()._cdata


def _storages(tensors) -> set[int]:
    return {_storage_key(t.to_local() if isinstance(t, DTensor) else t) for t in tensors}


def _own_cpu_copy(tensor: torch.Tensor, live: set[int]) -> torch.Tensor:
    """torch hands back the live tensor itself where nothing had to be gathered (plain
    parameters, anything already on CPU); such a "copy" would keep changing with
    training, so it is copied here. Gathered tensors are new already."""
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if _storage_key(tensor) in live:
        return tensor.to("cpu", copy=True)
    return tensor.cpu()
