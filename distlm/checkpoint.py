"""Checkpoints: save atomically, resume exactly, refuse to mix runs.

A checkpoint holds everything the next update depends on: model, optimizer, LR
schedule position, loss scaler, every rank's RNG state, the dictionary and the global
count of consumed samples. With DDP every replica holds the same model and optimizer,
so rank 0 writes one file; RNG states are gathered from all ranks first.
Files are written to a temporary name and renamed into place, so a crash mid-write
never leaves a truncated ``checkpoint_last.pt``.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from distlm.errors import UsageError

FORMAT_VERSION = 1
LAST = "checkpoint_last.pt"


def numbered(update: int) -> str:
    return f"checkpoint_{update}.pt"


def resume_path(save_dir: str | os.PathLike) -> Path | None:
    path = Path(save_dir) / LAST
    return path if path.is_file() else None


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Load with ``weights_only=True``: a checkpoint is data, never code to execute."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"{path}: not a readable distlm checkpoint ({reason})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise UsageError(f"{path}: not a distlm checkpoint of format {FORMAT_VERSION}")
    return state


def check_resumable(state: dict[str, Any], path: Path, arch: str, task: str) -> None:
    """A save dir belongs to one model: never resume (or overwrite) another's checkpoint."""
    if state["arch"] != arch or state["task"] != task:
        raise UsageError(
            f"--save-dir {path.parent} holds a checkpoint of --arch {state['arch']} --task {state['task']}, "
            f"not --arch {arch} --task {task}; use another --save-dir (the existing checkpoint is left untouched)"
        )


def save(state: dict[str, Any], save_dir: str | os.PathLike, names: list[str]) -> None:
    """Write ``state`` under each name in ``save_dir``, each file appearing whole or not at all."""
    directory = Path(save_dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT_VERSION, **state}
    for name in names:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# Full (unsharded) state under the single-device model's parameter names, whatever wraps
# the model (DDP, FSDP2, DTensor tensor parallel), so the checkpoint of one strategy and
# world size loads into another. With rank0_only, only rank 0 holds the gathered copy.


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Consolidated weights on CPU under the single-device names, as tensors of their own.

    A collective under FSDP: every rank must call it. With ``rank0_only`` (the
    default) only rank 0 receives the tensors and the other ranks get ``{}``, so no
    rank but the writer holds a full copy. Works for plain and DDP models too.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    live = _storages(list(model.parameters()) + list(model.buffers()))
    # Tied names keep sharing one tensor, so export still stores it once.
    copies: dict[tuple, torch.Tensor] = {}
    result = {}
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
        if key not in copies:
            copies[key] = _own_cpu_copy(tensor, live)
        result[name] = copies[key]
    return result


def load_full_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], *, from_rank0: bool = False
) -> None:
    """Inverse of ``full_state_dict``; each rank keeps only its own shard.

    By default every rank passes the full weights (each rank has read the checkpoint
    file). With ``from_rank0`` only rank 0 does, the others pass ``{}`` and rank 0's
    tensors are broadcast, so one full copy exists at a time (collective; FSDP only).
    """
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
    set_model_state_dict(model, _copy_containers(state_dict), options=options)


def full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, rank0_only: bool = True
) -> dict[str, Any]:
    """Consolidated optimizer state keyed by parameter name (not index), on CPU.

    Names rather than indices make the state independent of how the strategy
    orders or shards parameters. Same collective and rank-0 rules as ``full_state_dict``.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    live = _storages(v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor))
    return _map_tensors(state, lambda tensor: _own_cpu_copy(tensor, live))


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], *, from_rank0: bool = False
) -> None:
    """Inverse of ``full_optimizer_state_dict``, with ``load_full_state_dict``'s ``from_rank0`` rule.

    Call it after the optimizer exists and before its first step; the state it loads
    is sliced to this rank's shards.
    """
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
    # torch first creates the state with one step on zero gradients; tensor parallel with no
    # data-parallel wrapper leaves plain parameters (norms) beside DTensors, a mix that
    # torch's foreach kernels refuse unless the plain ones are taken as replicated (they are).
    with implicit_replication():
        set_optimizer_state_dict(model, optimizer, _copy_containers(state_dict), options=options)


def _storages(tensors) -> set[int]:
    return {
        (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in tensors
    } - {0}


def _own_cpu_copy(tensor: torch.Tensor, live: set[int]) -> torch.Tensor:
    """torch hands back the live tensor itself where nothing had to be gathered (plain
    parameters, Adam's step counters, anything already on CPU); such a "copy" would
    keep changing with training, so it is copied here. Gathered tensors are new already."""
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if tensor.untyped_storage().data_ptr() in live:
        return tensor.to("cpu", copy=True)
    return tensor.cpu()


def _map_tensors(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _copy_containers(value: Any) -> Any:
    """New dicts and lists around the same tensors: torch's loaders replace entries of the
    state dict they are given with this rank's shards, which must not leak to the caller."""
    if isinstance(value, dict):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    return value


def gather_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state, gathered whole to rank 0 (collective: every rank calls it).

    The optimizer state is keyed by parameter name, as torch.distributed.checkpoint keys
    it; ZeRO-1's own gathered state (keyed by position) is renamed to match, so a
    checkpoint moves between ddp, zero1 and fsdp.
    """
    from distlm.parallel.zero1 import Zero1Optimizer

    model_state = full_state_dict(model)
    if isinstance(optimizer, Zero1Optimizer):
        full = optimizer.full_state_dict()
        return model_state, _rekey(full, dict(enumerate(_trainable_names(model)))) if full is not None else {}
    return model_state, full_optimizer_state_dict(model, optimizer)


def consolidated_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, under its single-device name, on every rank (collective).

    The same gathering the checkpoint and export use, without the rank-0-only offload.
    """
    names = set(parameter_names(model))
    return {name: tensor for name, tensor in full_state_dict(model, rank0_only=False).items() if name in names}


def load_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Every rank passes the whole state; each keeps its own shard of it."""
    from distlm.parallel.zero1 import Zero1Optimizer

    load_full_state_dict(model, model_state)
    if isinstance(optimizer, Zero1Optimizer):
        optimizer.load_state_dict(_rekey(optim_state, {n: i for i, n in enumerate(_trainable_names(model))}))
    else:
        load_full_optimizer_state_dict(model, optimizer, optim_state)


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters an optimizer holds, in order: ZeRO-1 numbers only these."""
    return [name for name, param in zip(parameter_names(model), model.parameters()) if param.requires_grad]


def parameter_names(model: torch.nn.Module) -> list[str]:
    """Single-device names of ``model.parameters()``, in that order (wrapper prefixes removed)."""
    return [single_device_name(name) for name, _ in model.named_parameters()]


# Levels that compile and activation checkpointing insert anywhere in a name.
_INSERTED_LEVELS = {"_orig_mod", "_checkpoint_wrapped_module"}


def single_device_name(name: str) -> str:
    """A parameter's or buffer's name in the single-device model, whatever wraps it."""
    name = name.removeprefix("module.")  # DDP's leading level
    return ".".join(part for part in name.split(".") if part not in _INSERTED_LEVELS)


def _rekey(optim_state: dict, key_of: dict) -> dict:
    """The same optimizer state with each parameter key replaced through ``key_of``."""
    return {
        "state": {key_of[k]: v for k, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [key_of[k] for k in g["params"]]} for g in optim_state["param_groups"]],
    }


def capture_rng() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
