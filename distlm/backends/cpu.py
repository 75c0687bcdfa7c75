"""CPU: gloo collectives over TCP; every precision autocasts on CPU in torch 2.13."""

from __future__ import annotations

import torch

from distlm.backends.base import Backend
from distlm.errors import UsageError
from distlm.launch.cluster_env import ClusterEnv


class CpuBackend(Backend):
    name = "cpu"
    dist_backend = "gloo"

    @property
    def autocast_device_type(self) -> str:
        return "cpu"

    def device(self, env: ClusterEnv) -> torch.device:
        return torch.device("cpu")

    def check_network(self, network: str) -> None:
        super().check_network(network)
        if network == "efa":
            # gloo only speaks TCP sockets; there is no libfabric path to switch on.
            raise UsageError("--network efa needs --device cuda, neuron or xla; gloo on --device cpu uses TCP only")
