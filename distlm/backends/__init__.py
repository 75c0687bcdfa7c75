"""Hardware backends: cpu (gloo), cuda (nccl), neuron (TorchNeuron), xla (torch-xla); chosen by ``get_backend``.

Layer: may import distlm's errors, choices and precision and ``distlm.launch``; never the
runtime, models, parallel, data or anything above.
"""

from distlm.backends.base import Backend, DistributedInitError, DistributedTimeout
from distlm.backends.registry import get_backend, resolve_device

__all__ = ["Backend", "DistributedInitError", "DistributedTimeout", "get_backend", "resolve_device"]
