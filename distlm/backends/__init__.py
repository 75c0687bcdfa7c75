"""Hardware backends: cpu (gloo), cuda (nccl), neuron (TorchNeuron), xla (torch-xla); chosen by ``get_backend``."""

from distlm.backends.base import Backend, DistributedInitError, DistributedTimeout
from distlm.backends.registry import get_backend, resolve_device

__all__ = ["Backend", "DistributedInitError", "DistributedTimeout", "get_backend", "resolve_device"]
