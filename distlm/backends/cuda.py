"""CUDA: NCCL collectives, one GPU per local rank, bf16 only from Ampere on.

The rules that do not need a GPU -- which precisions a compute capability supports,
which GPUs have EFA RDMA -- are pure functions of the capability, so they are tested
on a CPU-only machine. Device choice and the EFA preset are the accelerator base's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping

import torch

from distlm.backends.accelerator import AcceleratorBackend
from distlm.backends.base import check_precision_name
from distlm.backends.efa import apply_env_preset
from distlm.errors import UsageError


def check_cuda_precision(precision: str, capability: tuple[int, int]) -> None:
    """UsageError when a GPU of ``capability`` cannot train in ``precision``."""
    check_precision_name(precision)
    if precision == "bf16" and tuple(capability) < (8, 0):
        major, minor = capability
        raise UsageError(
            f"--bf16 needs a GPU with compute capability 8.0 or newer (Ampere); this one is sm{major}{minor} "
            "(V100-class); use --fp16 instead (dynamic loss scaling)"
        )


def supports_gpudirect_rdma(capability: tuple[int, int]) -> bool:
    """Whether the instance behind this GPU has EFA RDMA read, judged by the GPU it carries.

    The EFA instances with RDMA are the A100 (8.0), H100/H200 (9.0) and B200 (10.0)
    families; the workstation-class parts AWS also pairs with EFA (A10G 8.6, L4/L40S 8.9
    on g5/g6/g6e) lack it, so ``minor == 0`` is part of the test.
    """
    major, minor = capability
    return major >= 8 and minor == 0


def flight_recorder_preset(dump_dir: str) -> dict[str, str]:
    """NCCL's flight recorder, as torchtitan configures it: the last 20,000 collectives of
    each rank kept in memory and written to ``dump_dir/rank_<r>`` when the watchdog sees a
    timeout, so a hang can be traced to the collective and ranks that did not arrive."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(dump_dir) / "rank_"),
    }


class CudaBackend(AcceleratorBackend):
    name = "cuda"
    dist_backend = "nccl"
    device_type = "cuda"
    visible_devices_variable = "CUDA_VISIBLE_DEVICES"

    def record_collectives(self, dump_dir: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        environ = os.environ if environ is None else environ
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        applied, _ = apply_env_preset(flight_recorder_preset(dump_dir), environ)
        return applied
    compile_cache_variables = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}

    def require_runtime(self) -> None:
        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda but torch.cuda.is_available() is False; install a CUDA build of torch "
                "on a GPU machine, or use --device cpu"
            )

    def check_precision(self, precision: str) -> None:
        check_precision_name(precision)
        if torch.cuda.is_available():
            check_cuda_precision(precision, torch.cuda.get_device_capability(torch.cuda.current_device()))

    def check_device_precision(self, precision: str, index: int) -> None:
        check_cuda_precision(precision, torch.cuda.get_device_capability(index))

    def supports_gpudirect_rdma(self, index: int) -> bool:
        return supports_gpudirect_rdma(torch.cuda.get_device_capability(index))
