"""What CUDA GPUs and Trainium NeuronCores share: one process per device, through ``torch.accelerator``.

PyTorch drives every accelerator that registers with it -- CUDA built in, Trainium
through TorchNeuron's PrivateUse1 backend -- with the same device-generic API:
``torch.accelerator`` counts, selects and synchronises devices, and a device-type string
names them in ``torch.device`` and ``torch.autocast``. So which device a local rank uses,
selecting it before any process group, the EFA network preset and synchronisation live
here once. A subclass says only where its hardware really differs: the runtime it
needs, the process-group backend, precisions, GPUDirect RDMA, the compile backend.
"""

from __future__ import annotations

import os

import torch

from distlm.backends.base import Backend
from distlm.backends.efa import configure_network
from distlm.launch.cluster_env import ClusterEnv
from distlm.launch.devices import device_index


class AcceleratorBackend(Backend):
    """A PyTorch accelerator with one device per local rank."""

    device_type: str = ""
    """The device type of ``torch.device`` and ``torch.autocast``: ``cuda``, ``neuron``."""
    visible_devices_variable: str = ""
    """The variable that restricts which devices a process sees, named in errors."""
    sysfs_root: str = "/sys"
    """Where EFA devices are looked for (``class/infiniband``)."""

    @property
    def autocast_device_type(self) -> str:
        return self.device_type

    def require_runtime(self) -> None:
        """UsageError, saying what to install, unless PyTorch can drive this accelerator."""
        raise NotImplementedError

    def check_device_precision(self, precision: str, index: int) -> None:
        """UsageError if device ``index`` cannot train in ``precision``."""
        self.check_precision(precision)

    def supports_gpudirect_rdma(self, index: int) -> bool:
        """Whether EFA can read device ``index``'s memory directly (the RDMA part of the EFA preset)."""
        return False

    def visible_devices(self) -> int:
        """Devices of this type this process sees (0 when PyTorch drives another accelerator or none)."""
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != self.device_type:
            return 0
        return torch.accelerator.device_count()

    def device_index(self, env: ClusterEnv) -> int:
        """The device of local rank ``env.local_rank``: its own when it sees one, else local rank modulo those it sees."""
        return device_index(env.local_rank, env.local_world_size, self.visible_devices(), self.visible_devices_variable)

    def device(self, env: ClusterEnv) -> torch.device:
        return torch.device(self.device_type, self.device_index(env))

    def setup(self, env: ClusterEnv, precision: str, network: str = "auto") -> None:
        self.require_runtime()
        index = self.device_index(env)
        torch.accelerator.set_device_index(index)
        self.check_device_precision(precision, index)
        # Before the process group: NCCL, the Neuron runtime and libfabric read these at
        # communicator start.
        configure_network(network, os.environ, self.supports_gpudirect_rdma(index), self.sysfs_root,
                          log=env.rank == 0)

    def synchronize(self) -> None:
        torch.accelerator.synchronize()
