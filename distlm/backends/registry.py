"""``--device auto|cpu|cuda|neuron`` -> a Backend. The only place devices are chosen."""

from __future__ import annotations

import os

import torch

from distlm.backends.base import Backend
from distlm.backends.cpu import CpuBackend
from distlm.backends.cuda import CudaBackend
from distlm.backends.neuron import NeuronBackend, neuron_available
from distlm.choices import DEVICES
from distlm.errors import UsageError

BACKENDS: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "neuron": NeuronBackend}


def resolve_device(device: str, dev_root: str | os.PathLike = "/dev") -> str:
    """``auto`` -> neuron if a Neuron device and torch-neuronx exist, else cuda if available, else cpu."""
    if device not in DEVICES:
        raise UsageError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device != "auto":
        return device
    if neuron_available(dev_root):
        return "neuron"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def get_backend(device: str) -> Backend:
    return BACKENDS[resolve_device(device)]()
