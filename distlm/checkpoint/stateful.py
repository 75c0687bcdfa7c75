"""The sharded training state each rank saves and loads, keyed by single-device names,
and the ``Stateful`` objects that hand it to the Checkpointer.

Every strategy presents the same keys, so a checkpoint written under one layout loads
under any other; torch.distributed.checkpoint (DCP) reads whatever slices of the saved
shards each rank's own shards need:

``model.<name>``                       the parameter (a DTensor under FSDP and tensor parallel)
``optimizer.<name>.<step|exp_avg|…>``  Adam's state, only where this rank holds it (ZeRO-1: its partition)
``rng.rank<r>.<cpu|cuda>``             each rank's RNG state, restored when the layout is unchanged

Replicated tensors (DDP's parameters and moments) are written once, by one rank, and
read by all. No rank gathers anything whole.

The model's state comes from torch's ``get_model_state_dict``/``set_model_state_dict``.
The optimizer's does not: torch's ``get_optimizer_state_dict`` keys it
``optimizer.state.<name>.<field>`` and cannot read ZeRO-1's partitions, so the names
above are kept by distlm's own functions.

``training_states`` names the Stateful objects of a training run (model, optimizer, loss
scaler, ``TrainProgress``, RNG); ``seed_dropout`` is the one rule that seeds dropout when no
saved RNG state applies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, distribute_tensor

from distlm.optim import init_optimizer_state
from distlm.state.names import parameter_names

# The names of the training state in a checkpoint. Any other Stateful registered beside
# them is saved and resumed the same way: tensors in the shards under its name, a state
# without tensors in distlm.json under its name.
MODEL, OPTIMIZER, SCALER, PROGRESS, RNG = "model", "optimizer", "scaler", "progress", "rng"


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter (and persistent buffer), under single-device names."""
    return get_model_state_dict(model)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    set_model_state_dict(model, state, options=StateDictOptions(strict=strict))


def optimizer_holding_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``state`` is this rank's: ZeRO-1's local optimizer, else itself."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's state of the parameters this rank holds state for, by parameter name.

    The tensors are the optimizer's own (loading writes into them in place).
    """
    holder = optimizer_holding_state(optimizer)
    name_of = {id(param): name for name, param in zip(parameter_names(model), model.parameters())}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for group in holder.param_groups:
        for param in group["params"]:
            entry = holder.state.get(param)
            if entry:
                state[name_of[id(param)]] = {key: value for key, value in entry.items()
                                             if isinstance(value, torch.Tensor)}
    return state


def optimizer_state_to_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved_keys: set[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """``optimizer_state`` after allocating it, restricted to what the checkpoint holds.

    Allocating lays the state out as this strategy holds it (sharded like the
    parameters), so loading reads only this rank's slices. A parameter without saved
    state (a checkpoint from before its first step) keeps none.
    """
    holder = optimizer_holding_state(optimizer)
    init_optimizer_state(holder)
    state = optimizer_state(model, optimizer)
    name_to_param = dict(zip(parameter_names(model), model.parameters()))
    for name in list(state):
        if not all(f"optimizer.{name}.{key}" in saved_keys for key in state[name]):
            holder.state.pop(name_to_param[name], None)
            del state[name]
    return state


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, full: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Load whole per-name tensors (a checkpoint of the old single-file format), keeping this rank's shards."""
    holder = optimizer_holding_state(optimizer)
    init_optimizer_state(holder)
    for name, entry in optimizer_state(model, optimizer).items():
        if name not in full:
            continue
        for key, target in entry.items():
            _copy_shard_into(target, full[name][key])


@torch.no_grad()
def _copy_shard_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank cuts its own shard from the whole tensor, no communication.
        whole = distribute_tensor(whole.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(whole.to_local())
    else:
        target.copy_(whole)


def _accelerator_rng() -> tuple[str, Any] | None:
    """(device type, device module) of this process's accelerator when it keeps an RNG
    state in use: torch.cuda, or TorchNeuron's neuron module, through torch.accelerator."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return None
    module = torch.get_device_module(accelerator.type)
    if not hasattr(module, "get_rng_state") or not getattr(module, "is_initialized", lambda: True)():
        return None
    return accelerator.type, module


def capture_rng() -> dict[str, torch.Tensor]:
    """The host's RNG state and the accelerator's (dropout draws on the device there)."""
    states = {"cpu": torch.get_rng_state()}
    accelerator = _accelerator_rng()
    if accelerator is not None:
        states[accelerator[0]] = accelerator[1].get_rng_state()
    return states


def restore_rng(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    accelerator = _accelerator_rng()
    if accelerator is not None and accelerator[0] in states:
        accelerator[1].set_rng_state(states[accelerator[0]])


# ------------------------------------------------------------- Stateful objects


class ModelState:
    """The model as a ``Stateful``: its shards under single-device names."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return model_state(self.model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        # Not strict: the Checkpointer compared names and shapes first, and a partial load
        # (--load-partial) hands over only the weights the checkpoint and the model share.
        load_model_state(self.model, state, strict=False)


class OptimizerState:
    """AdamW's state (ZeRO-1: this rank's partition) as a ``Stateful``.

    Like torch's ``get_optimizer_state_dict``, ``state_dict`` allocates the state of a
    parameter that has none yet, so a load has tensors to read into; ``load_state_dict``
    drops again the state of every parameter the loaded dict lacks.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        init_optimizer_state(optimizer_holding_state(self.optimizer))
        return optimizer_state(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        holder = optimizer_holding_state(self.optimizer)
        for name, param in zip(parameter_names(self.model), self.model.parameters()):
            entry = holder.state.get(param)
            if entry and (name not in state or state[name].keys() != {
                    key for key, value in entry.items() if isinstance(value, torch.Tensor)}):
                holder.state.pop(param)  # a parameter without saved state (a checkpoint from before its first step)
                continue
            for key, value in state.get(name, {}).items():
                if entry[key] is not value:
                    _copy_shard_into(entry[key], value)


class RNGState:
    """This rank's random number generators as a ``Stateful``, under ``rank<r>``."""

    def __init__(self, rank: int):
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self.key: capture_rng()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        restore_rng(state[self.key])


def seed_dropout(seed: int, dp_rank: int, num_updates: int = 0) -> None:
    """Seed this rank's generators for dropout where no saved RNG state applies: a fresh run,
    or a resume whose saved streams belong to another layout.

    By data-parallel rank, not by rank: dropout differs per data-parallel replica, yet
    reproducibly, and the tensor-parallel ranks of one replica must draw the same masks in
    their replicated regions. A resume at update ``num_updates`` mixes the count in, so the
    masks after it are not those the run already drew from its first update.
    """
    torch.manual_seed(seed * 1000 + dp_rank + 7919 * num_updates)


@dataclass
class TrainProgress:
    """Where training stands; saved in every checkpoint."""

    num_updates: int = 0
    consumed_samples: int = 0
    best: float | None = None
    """Best validation value so far (``--best-checkpoint-metric``)."""
    validations_without_improvement: int = 0
    train_wall: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take the progress a checkpoint recorded. Keys this version does not keep are
        dropped: ``lr_schedule_start``, written by earlier versions, is one (the schedule
        follows the update count)."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, saved.get(field.name, field.default))


def training_states(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, progress: TrainProgress,
                    rank: int) -> dict[str, Stateful]:
    """The Stateful objects of a training run, by their names in the checkpoint."""
    states: dict[str, Stateful] = {MODEL: ModelState(model), OPTIMIZER: OptimizerState(model, optimizer),
                                   PROGRESS: progress, RNG: RNGState(rank)}
    if scaler is not None:
        states[SCALER] = scaler
    return states
