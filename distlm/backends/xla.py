"""Any PJRT device through torch-xla: trn1 with the torch-xla based torch-neuronx, TPU, or XLA's CPU.

XLA tensors are lazy: operations record a graph that compiles and runs at
``torch_xla.sync()``, called once per update, after the optimizer step. Data parallelism
is torch DDP over the ``xla`` process group (``xla://`` takes rank and world size from
torchrun's variables, as the Neuron runtime does), optionally with ZeRO-1's sharded
optimizer state. FSDP2 and DTensor tensor parallel shard over the dimensions of a
DeviceMesh, and torch builds no process groups for an ``xla`` mesh, so they are refused:
on trn2/trn3, TorchNeuron (``--device neuron``) runs them.

torch_xla's process group finds rank and world size through its PJRT client, whose CPU
client (``PJRT_DEVICE=CPU``) has no multi-process coordinator in torch-xla 2.9: under
torchrun every process becomes rank 0 of a world of 1 and trains alone. So XLA's CPU
device runs one process only, and every process group is checked against the launcher.

torch_xla is imported inside methods only: importing it starts choosing a PJRT device,
and this module must load where torch-xla is absent.
"""

from __future__ import annotations

import datetime
import importlib
import os
from types import ModuleType

import torch
import torch.distributed as dist

from distlm.backends.base import Backend, describe_init_failure, module_importable, refuse_fp16
from distlm.backends.efa import configure_network
from distlm.errors import UsageError
from distlm.launch.cluster_env import ClusterEnv

TORCH_XLA_HINT = (
    "install torch-xla of the same release as torch (pip install torch-xla==X.Y.Z with torch==X.Y.Z), "
    "or on trn1 the torch-xla based torch-neuronx from AWS's Neuron repository "
    "(--extra-index-url https://pip.repos.neuron.amazonaws.com)"
)


def import_xla_module(name: str) -> ModuleType:
    """``name`` (torch_xla or one of its modules), or a UsageError saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise UsageError(f"--device xla needs torch-xla, but {name} failed to import ({err}); {TORCH_XLA_HINT}") from None


class XlaBackend(Backend):
    name = "xla"
    dist_backend = "xla"
    compile_backend = "openxla"
    static_shapes = True
    compile_cache_variables = {"NEURON_COMPILE_CACHE_URL": "neuron", "XLA_PERSISTENT_CACHE_PATH": "xla"}
    # torch_xla replaces torch.nn.utils.clip_grad_norm_ on import with a version that
    # raises for foreach=True; None takes its XLA implementation.
    foreach_clip = None

    @property
    def autocast_device_type(self) -> str:
        return "xla"

    def device(self, env: ClusterEnv) -> torch.device:
        # Under torchrun each process's PJRT client sees only its own device.
        torch_xla = import_xla_module("torch_xla")
        if hasattr(torch_xla, "device"):
            return torch_xla.device()
        return import_xla_module("torch_xla.core.xla_model").xla_device()  # older torch-xla

    def check_precision(self, precision: str) -> None:
        refuse_fp16(precision, "xla",
                    "XLA devices (Trainium, TPU) compute in bf16 and torch-xla has no fp16 dynamic loss scaling here")

    def check_strategy(self, strategy: str, tp_degree: int) -> None:
        if strategy == "fsdp":
            raise UsageError(
                "--strategy fsdp is FSDP2 (fully_shard), which torch-xla's process group cannot run; "
                "on --device xla use --strategy ddp or zero1 (or --device neuron, TorchNeuron, on trn2/trn3)"
            )
        if tp_degree > 1:
            raise UsageError(
                f"--tp-degree {tp_degree} is DTensor tensor parallel, which torch-xla's process group cannot run; "
                "on --device xla use --tp-degree 1 (or --device neuron, TorchNeuron, on trn2/trn3)"
            )

    def setup(self, env: ClusterEnv, precision: str, network: str = "auto") -> None:
        self.check_precision(precision)
        if env.world_size > 1 and env.launcher != "torchelastic":
            # xla:// and the Neuron runtime's own rendezvous read torchrun's variables
            # (LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR); AWS runs multi-node jobs as `srun torchrun`.
            raise UsageError(
                f"--device xla with {env.world_size} processes needs torchrun (found launcher {env.launcher}); "
                "under Slurm run `srun torchrun --nnodes $SLURM_NNODES --nproc-per-node 32 ...`"
            )
        if not module_importable("torch_xla"):
            raise UsageError(f"--device xla needs torch-xla, which is not installed; {TORCH_XLA_HINT}")
        chosen_by_user = "PJRT_DEVICE" in os.environ
        # Before torch-xla starts its runtime, which reads them.
        configure_network(network, os.environ, gpudirect_rdma=True, log=env.rank == 0)
        import_xla_module("torch_xla")  # chooses PJRT_DEVICE when unset: TPU, then Neuron, else CPU
        pjrt_device = import_xla_module("torch_xla.runtime").device_type()
        if pjrt_device == "CPU" and not chosen_by_user:
            raise UsageError(
                "--device xla found no XLA accelerator (no TPU, no Neuron PJRT plugin), and torch-xla would train "
                "on its CPU device; install the device's plugin (torch-neuronx on trn1), or export PJRT_DEVICE=CPU "
                "to run on XLA's CPU device on purpose"
            )
        if pjrt_device == "CPU" and env.world_size > 1:
            raise UsageError(
                f"--device xla with PJRT_DEVICE=CPU runs one process only, not {env.world_size}: torch-xla's CPU "
                "client has no multi-process coordinator, so every process would train alone as rank 0 of 1; "
                "start one process, or use --device cpu for several"
            )
        if env.world_size == 1:
            # The autograd engine sizes its per-device queues at the first backward of the
            # process; an XLA device that did not exist then fails later with an internal
            # assert. With several processes the xla:// rendezvous starts the device, after
            # telling the PJRT client which process of the node it is.
            self.device(env)

    def init_process_group(self, env: ClusterEnv, timeout: datetime.timedelta) -> None:
        import_xla_module("torch_xla.distributed.xla_backend")  # registers backend "xla" and xla://
        try:
            dist.init_process_group(self.dist_backend, init_method="xla://", timeout=timeout)
        except (dist.DistError, RuntimeError) as err:
            raise describe_init_failure(err, env, env.master_port or 0, timeout, "the xla process group") from err
        self.check_joined_world(env)

    def mark_step(self) -> None:
        torch_xla = import_xla_module("torch_xla")
        if hasattr(torch_xla, "sync"):
            torch_xla.sync()
        else:
            import_xla_module("torch_xla.core.xla_model").mark_step()  # older torch-xla

    def synchronize(self) -> None:
        import_xla_module("torch_xla.core.xla_model").wait_device_ops()
