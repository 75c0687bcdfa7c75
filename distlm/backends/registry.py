"""``--device auto|cpu|cuda|neuron|xla`` -> a Backend. The only place devices are chosen."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from distlm.backends.base import Backend, module_importable
from distlm.backends.cpu import CpuBackend
from distlm.backends.cuda import CudaBackend
from distlm.backends.neuron import NeuronBackend
from distlm.backends.xla import XlaBackend
from distlm.choices import DEVICES
from distlm.errors import UsageError

BACKENDS: dict[str, type[Backend]] = {
    "cpu": CpuBackend, "cuda": CudaBackend, "neuron": NeuronBackend, "xla": XlaBackend,
}


def neuron_device_present(dev_root: str | os.PathLike = "/dev") -> bool:
    """A Neuron device node exists (Trainium or Inferentia2 attached)."""
    return (Path(dev_root) / "neuron0").exists()


def resolve_device(device: str, dev_root: str | os.PathLike = "/dev") -> str:
    """``auto`` -> on a Neuron device, xla where torch-xla is installed (trn1's torch-neuronx is
    built on it) and neuron where TorchNeuron's torch_neuronx is; else cuda if available, else cpu."""
    if device not in DEVICES:
        raise UsageError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device != "auto":
        return device
    if neuron_device_present(dev_root):
        if module_importable("torch_xla"):
            return "xla"
        if module_importable("torch_neuronx"):
            return "neuron"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def get_backend(device: str) -> Backend:
    return BACKENDS[resolve_device(device)]()
