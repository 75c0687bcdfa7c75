"""Single-device names of parameters and buffers, whatever wraps the model, and the local
shard of a (DTensor) parameter.

DDP adds ``module.``; compile, activation checkpointing and FSDP's wrappers insert
levels of their own. Checkpoints, exports and replica checks use the names of the
single-device model, so they stay stable across strategies.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

# Levels that compile and activation checkpointing insert anywhere in a name.
_INSERTED_LEVELS = {"_orig_mod", "_checkpoint_wrapped_module"}


def single_device_name(name: str) -> str:
    """A parameter's or buffer's name in the single-device model, whatever wraps it."""
    name = name.removeprefix("module.")  # DDP's leading level
    return ".".join(part for part in name.split(".") if part not in _INSERTED_LEVELS)


def parameter_names(model: nn.Module) -> list[str]:
    """Single-device names of ``model.parameters()``, in that order (wrapper prefixes removed)."""
    return [single_device_name(name) for name, _ in model.named_parameters()]


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters an optimizer holds, in order."""
    return [name for name, param in zip(parameter_names(model), model.parameters()) if param.requires_grad]


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameter names that refer to a parameter already named earlier: alias -> first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name = single_device_name(name)
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def unwrap(model: nn.Module) -> nn.Module:
    """The user's single-device module inside DDP and compile wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        else:
            return model


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
