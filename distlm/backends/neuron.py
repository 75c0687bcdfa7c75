"""AWS Trainium / Inferentia2 through torch-xla (the Neuron PyTorch path, torch-neuronx).

XLA tensors are lazy: operations record a graph that runs at ``mark_step``. The process
group backend is "xla", registered by importing ``torch_xla.distributed.xla_backend``.
torch_xla is imported inside methods only, through ``_import_xla``, so this module loads
(and is tested with a stand-in) where torch-xla is absent.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from distlm.backends.base import Backend, describe_init_failure, check_precision_name
from distlm.backends.cuda import configure_network
from distlm.env import ClusterEnv
from distlm.errors import UsageError

NEURON_PIP_HINT = (
    "pip install torch-neuronx --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "(AWS's Neuron pip repository; the PyPI package of that name is a placeholder), "
    "or use the AWS Deep Learning AMI/container for Neuron"
)


def _import_xla_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise UsageError(f"--device neuron needs torch-xla, but {name} failed to import ({err}); {NEURON_PIP_HINT}") from None


def _import_xla() -> tuple[ModuleType, ModuleType]:
    """(torch_xla, torch_xla.core.xla_model), or a UsageError saying how to install them."""
    return _import_xla_module("torch_xla"), _import_xla_module("torch_xla.core.xla_model")


def _module_importable(name: str) -> bool:
    """Without importing it: importing torch_xla starts its runtime."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def neuron_available(dev_root: str | os.PathLike = "/dev") -> bool:
    """torch-xla and torch-neuronx importable, and a Neuron device node present."""
    return (
        _module_importable("torch_xla")
        and _module_importable("torch_neuronx")
        and (Path(dev_root) / "neuron0").exists()
    )


class NeuronBackend(Backend):
    name = "neuron"
    dist_backend = "xla"

    @property
    def autocast_device_type(self) -> str:
        return "xla"

    def device(self, env: ClusterEnv) -> torch.device:
        torch_xla, xla_model = _import_xla()
        # torch_xla.device() replaces xm.xla_device() from torch-xla 2.6 on. Under
        # torchrun each process sees only its own NeuronCore, so no index is passed.
        if hasattr(torch_xla, "device"):
            return torch_xla.device()
        return xla_model.xla_device()

    def check_precision(self, precision: str) -> None:
        check_precision_name(precision)
        if precision in ("fp16", "memory_efficient_fp16"):
            flag = "--fp16" if precision == "fp16" else "--memory-efficient-fp16"
            raise UsageError(
                f"{flag} is not supported on --device neuron: Trainium computes natively in bf16 and the "
                "Neuron recipe has no fp16 dynamic loss scaling; use --bf16 (or fp32)"
            )

    def setup(self, env: ClusterEnv, precision: str, network: str = "auto") -> None:
        self.check_precision(precision)
        if env.world_size > 1 and env.launcher != "torchelastic":
            # torch-neuronx sets up the Neuron runtime's own rendezvous from torchrun's
            # variables (MASTER_ADDR, LOCAL_WORLD_SIZE...); AWS runs multi-node Neuron
            # jobs as `srun torchrun`, so that is what we support.
            raise UsageError(
                f"--device neuron with {env.world_size} processes needs torchrun (found launcher {env.launcher}); "
                "under Slurm run `srun torchrun --nnodes $SLURM_NNODES --nproc-per-node 32 ...`"
            )
        if not _module_importable("torch_xla"):
            raise UsageError(f"--device neuron needs torch-xla, which is not installed; {NEURON_PIP_HINT}")
        # PJRT_DEVICE=CPU runs the same torch-xla code path without Trainium (a test lane).
        if os.environ.get("PJRT_DEVICE", "NEURON").upper() == "NEURON" and not _module_importable("torch_neuronx"):
            raise UsageError(f"--device neuron needs torch-neuronx (the Neuron PJRT plugin); {NEURON_PIP_HINT}")
        # Before torch-xla starts its runtime, which reads them: Trn1/Trn2 EFA supports
        # RDMA, and the Neuron collectives reach it through libfabric as NCCL does.
        configure_network(network, os.environ, gpudirect_rdma=True, log=env.rank == 0)
        _import_xla()

    def init_process_group(self, env: ClusterEnv, timeout: datetime.timedelta) -> None:
        _import_xla_module("torch_xla.distributed.xla_backend")  # registers backend "xla" and xla://
        try:
            # xla:// takes rank, world size and master from torchrun's variables, the
            # way the Neuron runtime (which must agree with it) does.
            dist.init_process_group(self.dist_backend, init_method="xla://", timeout=timeout)
        except (dist.DistError, RuntimeError) as err:
            raise describe_init_failure(err, env, env.master_port or 0, timeout, "the xla process group") from err

    def mark_step(self) -> None:
        _, xla_model = _import_xla()
        xla_model.mark_step()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Not xm.optimizer_step(): it all-reduces every gradient across replicas before
        # stepping (xm.reduce_gradients). Our gradients are already reduced -- by DDP's
        # hooks, or sharded by FSDP/ZeRO-1 where a second all-reduce would mix different
        # shards -- so it would double the communication or corrupt the update. AWS's
        # DDP sample for torch-neuronx does the same: optimizer.step(), then mark_step().
        optimizer.step()
        self.mark_step()

    def synchronize(self) -> None:
        _, xla_model = _import_xla()
        xla_model.wait_device_ops()
