"""A stand-in for TorchNeuron's ``torch_neuronx``, for testing distlm where there is no Trainium.

Importing it does what importing the real package does: it registers the ``neuron``
device through PyTorch's PrivateUse1 backend (renamed, with a device module and
accelerator hooks, so ``torch.device("neuron", i)``, ``torch.accelerator`` and
``torch.autocast("neuron")`` work) and a ``neuron`` process-group backend. Nothing runs
on a NeuronCore: no tensor can be allocated on the ``neuron`` device, and the process
group is gloo under the ``neuron`` name, for CPU tensors.

The cores this process sees are those of ``NEURON_RT_VISIBLE_CORES`` (one core ``3``, a
range ``0-3`` or a list ``0,2``), or all ``STANDIN_INSTANCE_CORES`` of a pretend
instance (default 4) when it is unset, as the Neuron runtime reserves them all.

Used only by distlm's tests, which put this directory on ``sys.path``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

__version__ = "2.13.0+standin"
STANDIN = True

_DEFAULT_INSTANCE_CORES = 4


def visible_cores() -> list[int]:
    """The NeuronCores this process may use, as the Neuron runtime reads ``NEURON_RT_VISIBLE_CORES``."""
    setting = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if not setting:
        return list(range(int(os.environ.get("STANDIN_INSTANCE_CORES", _DEFAULT_INSTANCE_CORES))))
    cores: list[int] = []
    for part in setting.split(","):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


class _NeuronModule:
    """``torch.neuron``: what PyTorch asks of a PrivateUse1 device module."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return len(visible_cores())

    def current_device(self) -> int:
        return 0

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16]


class _NeuronHooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _NeuronDeviceGuard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _create_neuron_process_group(store, rank, world_size, timeout):
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _register() -> None:
    if torch._C._get_privateuse1_backend_name() != "neuron":
        _setup_privateuseone_for_python_backend(
            "neuron", backend_module=_NeuronModule(), hook=_NeuronHooks(), device_guard=_NeuronDeviceGuard()
        )
    if "neuron" not in dist.Backend.backend_list:
        dist.Backend.register_backend("neuron", _create_neuron_process_group, devices=["cpu", "neuron"])


_register()
