"""AWS Trainium through TorchNeuron, the native PyTorch backend of Neuron 2.33 and later.

``import torch_neuronx`` (the TorchNeuron package, 2.13.x / 2.14.x for torch 2.13 /
2.14) registers the ``neuron`` device through PyTorch's PrivateUse1 mechanism and the
``neuron`` process-group backend. Everything else is stock PyTorch, so Trainium differs
from CUDA only in the runtime it needs, the process-group backend, fp16 (refused: the
Neuron recipes train in bf16), the compile backend and the name of the variable that
restricts the cores a process sees. One process runs per logical NeuronCore, the core
of its local rank; DDP, FSDP2 and DTensor tensor parallel run through the same
``parallelize`` as on CUDA. torch_neuronx is imported in ``setup`` only, so this module
loads where it is absent.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from distlm.backends.accelerator import AcceleratorBackend
from distlm.backends.base import refuse_fp16
from distlm.errors import UsageError

NEURON_PACKAGE_INDEX = "https://pip.repos.neuron.amazonaws.com"


def torch_neuronx_hint() -> str:
    """Which TorchNeuron package this torch needs, and where it comes from."""
    torch_release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (
        f"install torch-neuronx 2.13.x or 2.14.x (TorchNeuron, the native backend), the release matching "
        f"torch {torch_release}, from AWS's Neuron repository: "
        f"pip install 'torch-neuronx=={torch_release}.*' --extra-index-url {NEURON_PACKAGE_INDEX} "
        "(the PyPI package of that name is a placeholder)"
    )


class NeuronBackend(AcceleratorBackend):
    name = "neuron"
    dist_backend = "neuron"
    device_type = "neuron"
    visible_devices_variable = "NEURON_RT_VISIBLE_CORES"
    compile_backend = "neuron"
    # The Neuron compiler's artefacts (NEFFs), as neuron_parallel_compile fills them.
    compile_cache_variables = {"NEURON_COMPILE_CACHE_URL": "neuron"}

    def require_runtime(self) -> None:
        try:
            importlib.import_module("torch_neuronx")
        except ImportError as err:
            raise UsageError(f"--device neuron needs torch-neuronx, which failed to import ({err}); "
                             f"{torch_neuronx_hint()}") from None
        # torch-neuronx before Neuron 2.33 is the torch-xla based package (trn1, inf2),
        # which imports fine but registers no neuron device.
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != "neuron" or "neuron" not in dist.Backend.backend_list:
            raise UsageError(
                "--device neuron needs TorchNeuron, but the torch_neuronx installed registers no neuron device "
                "and process group (it is the torch-xla based torch-neuronx: use --device xla with it); "
                + torch_neuronx_hint()
            )

    def check_precision(self, precision: str) -> None:
        refuse_fp16(precision, "neuron",
                    "Trainium computes natively in bf16 and the Neuron recipes have no fp16 dynamic loss scaling")

    def supports_gpudirect_rdma(self, index: int) -> bool:
        # Every Trainium instance with EFA reads device memory over it.
        return True
