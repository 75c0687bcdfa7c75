"""Facts about this machine's hardware: its cores, its EC2 instance type, and the peak
FLOP/s of one rank.

Peak FLOP/s are per rank: one GPU, one Trainium1 NeuronCore-v2, one Trainium2 logical
NeuronCore (LNC=2, four per chip), or this CPU as a timed matmul measures it. The device
of this process is named by torch for CUDA, and by the EC2 instance type for Trainium
(``neuron`` and ``xla`` devices): ``DISTLM_INSTANCE_TYPE``, else the DMI product name EC2
sets (``trn1.32xlarge``). ``DISTLM_PEAK_TFLOPS`` gives the peak of a device the table lacks.
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path

import torch

from distlm.choices import DEVICES
from distlm.errors import UsageError
from distlm.precision import DTYPES, dtype_name

# The CPU features that give fast half-precision matrix multiplies (oneDNN's AMX and AVX-512 kernels).
HALF_PRECISION_CPU_FLAGS = ("amx_fp16", "amx_bf16", "avx512_fp16", "avx512_bf16")


def cpu_model_and_flags() -> tuple[str | None, set[str]]:
    """This CPU's model name and instruction-set flags as /proc/cpuinfo gives them for its first
    processor; (None, no flags) where it cannot be read (not Linux)."""
    model, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags" and flags is None:
                    flags = set(value.split())
                if model is not None and flags is not None:
                    break
    except OSError:
        pass
    return model, flags or set()


def cpu_half_precision_flags() -> list[str]:
    """Which of ``HALF_PRECISION_CPU_FLAGS`` this CPU reports in /proc/cpuinfo (none where it cannot be read)."""
    flags = cpu_model_and_flags()[1]
    return [flag for flag in HALF_PRECISION_CPU_FLAGS if flag in flags]


# The instructions oneDNN multiplies each half type's matrices with, by the CPU flag that
# announces them, best first (oneDNN dispatches to the best the CPU has). AVX512-BF16's
# dot product does two multiply-adds per fp32 lane where an FMA does one: at most about
# twice fp32's rate. AMX tiles go far beyond that.
HALF_PRECISION_MATMUL_PATHS: dict[str, tuple[tuple[str, str], ...]] = {
    "bf16": (("amx_bf16", "AMX tiles through oneDNN's AMX kernels"),
             ("avx512_bf16", "AVX512-BF16 dot products through oneDNN's avx512_core_bf16 kernels, "
                             "at most about twice fp32's matrix rate")),
    "fp16": (("amx_fp16", "AMX-FP16 tiles through oneDNN's AMX kernels"),
             ("avx512_fp16", "AVX512-FP16 arithmetic through oneDNN's AVX512-FP16 kernels")),
}


def cpu_half_precision_path(precision: str, flags: list[str] | None = None) -> tuple[str | None, str]:
    """(the CPU flag, the instructions) that multiply ``precision``'s (bf16, fp16) matrices on
    this CPU, judged by its flags (``flags``, else /proc/cpuinfo's); (None, what is missing)
    where the CPU has no such instructions."""
    present = cpu_half_precision_flags() if flags is None else flags
    for flag, instructions in HALF_PRECISION_MATMUL_PATHS[precision]:
        if flag in present:
            return flag, instructions
    wanted = " nor ".join(flag for flag, _ in HALF_PRECISION_MATMUL_PATHS[precision])
    return None, f"no {precision} matrix instructions (neither {wanted})"


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity), which a CPU node's ranks share."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Dense (no sparsity) peak per rank, in TFLOP/s. fp32 means plain IEEE fp32 matmuls
# (no TF32), which is what torch runs unless TF32 is allowed.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA V100 SXM2: 125 tensor-core fp16, 15.7 fp32; no bf16.
    # https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    "V100": {"fp16": 125.0, "fp32": 15.7},
    # NVIDIA A100 SXM: 312 bf16/fp16 dense, 19.5 fp32.
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
    #   nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    # NVIDIA H100 SXM: 989 bf16/fp16 dense (the datasheet's 1,979 is with sparsity), 67 fp32.
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    # Trainium1 chip: 190 bf16/fp16 TFLOPS, 47.5 fp32, from two NeuronCore-v2: per core half.
    # https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium.html
    "trainium1": {"bf16": 95.0, "fp16": 95.0, "fp32": 23.75},
    # Trainium2 chip: 667 bf16/fp16 dense, 181 fp32, eight NeuronCore-v3; with the default
    # logical-core setting LNC=2 a rank is a pair of cores, four per chip: a quarter each.
    # https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium2.html
    "trainium2": {"bf16": 166.75, "fp16": 166.75, "fp32": 45.25},
}

# How device names spell each entry: torch.cuda.get_device_name(), and EC2 instance types
# (p3dn.24xlarge: V100, p4d/p4de: A100, p5.48xlarge: H100, trn1/trn1n: Trainium1, trn2: Trainium2).
_DEVICE_ALIASES = {
    "V100": ("v100", "p3.", "p3dn."),
    "A100": ("a100", "p4d.", "p4de."),
    "H100": ("h100", "p5."),
    "trainium1": ("trainium1", "trainium", "trn1", "neuroncore-v2"),
    "trainium2": ("trainium2", "trn2", "neuroncore-v3"),
}
DEVICE_TYPES = tuple(device for device in DEVICES if device != "auto")
INSTANCE_TYPE_VARIABLE = "DISTLM_INSTANCE_TYPE"
PEAK_VARIABLE = "DISTLM_PEAK_TFLOPS"
# EC2 writes the instance type here (e.g. "trn1.32xlarge"); containers may hide it.
PRODUCT_NAME_PATH = Path("/sys/devices/virtual/dmi/id/product_name")


def instance_type() -> str | None:
    """This machine's EC2 instance type: ``DISTLM_INSTANCE_TYPE``, else the DMI product
    name; None when neither says anything."""
    named = os.environ.get(INSTANCE_TYPE_VARIABLE, "").strip()
    if named:
        return named
    try:
        return PRODUCT_NAME_PATH.read_text().strip() or None
    except OSError:
        return None


def local_device_name(device_type: str) -> str | None:
    """The name of this process's ``device_type`` device for the peak table: torch's for
    CUDA, the instance type for Trainium (``neuron``, ``xla``); None when unknown."""
    if device_type == "cuda":
        return torch.cuda.get_device_name() if torch.cuda.is_available() else instance_type()
    if device_type in ("neuron", "xla"):
        return instance_type()
    return None


def device_key(device_type: str, device_name: str | None) -> str:
    """The ``PEAK_TFLOPS`` entry of a device, e.g. ``A100`` for "NVIDIA A100-SXM4-40GB" or
    ``trainium1`` for "trn1.32xlarge"."""
    name = (device_name or "").lower()
    # Longest alias first, so "trainium2" is not read as "trainium".
    for key, aliases in sorted(_DEVICE_ALIASES.items(), key=lambda item: -max(map(len, item[1]))):
        if any(alias in name for alias in aliases):
            return key
    known = ", ".join(PEAK_TFLOPS)
    if device_name is None and device_type in ("neuron", "xla"):
        raise UsageError(
            f"no peak FLOP/s known for the {device_type} device: no EC2 instance type found "
            f"(set {INSTANCE_TYPE_VARIABLE}, e.g. trn1.32xlarge or trn2.48xlarge, or {PEAK_VARIABLE})"
        )
    raise UsageError(
        f"no peak FLOP/s known for {device_type} device {device_name!r}; known devices: {known} "
        f"(set {PEAK_VARIABLE} to its dense peak, or calibrate with --calibrate)"
    )


def peak_flops(device_type: str, dtype: object, device_name: str | None = None) -> float:
    """Peak dense FLOP/s of one rank on ``device_type`` (cuda, neuron, xla, cpu) in ``dtype``.

    For ``cpu`` the peak is measured (``measure_cpu_matmul_flops``); without a
    ``device_name``, this process's device is named (``local_device_name``).
    """
    precision = dtype_name(dtype)
    if device_type == "cpu":
        return measure_cpu_matmul_flops(precision)
    if device_type not in DEVICE_TYPES:
        raise UsageError(f"device type {device_type!r} is unknown; choose one of {', '.join(DEVICE_TYPES)}")
    if device_name is None:
        device_name = local_device_name(device_type)
    key = device_key(device_type, device_name)
    table = PEAK_TFLOPS[key]
    if precision not in table:
        raise UsageError(f"{key} has no {precision} arithmetic; choose one of {', '.join(table)}")
    return table[precision] * 1e12


def device_peak_flops(device_type: str, dtype: object) -> float:
    """Peak FLOP/s of this process's accelerator in ``dtype``: ``DISTLM_PEAK_TFLOPS`` when
    set, else the table entry of the device (``peak_flops``). UsageError when neither knows."""
    given = os.environ.get(PEAK_VARIABLE, "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            value = 0.0
        if not value > 0 or not math.isfinite(value):
            raise UsageError(f"{PEAK_VARIABLE}={given!r} must be a positive number of TFLOP/s")
        return value * 1e12
    return peak_flops(device_type, dtype)


@functools.lru_cache(maxsize=None)
def measure_cpu_matmul_flops(
    dtype: object = "fp32", size: int = 512, min_seconds: float = 0.2, threads: int | None = None
) -> float:
    """Peak FLOP/s of ``threads`` cores of this CPU (default: torch's intra-op threads) in
    ``dtype``: ``threads`` times the best rate of one core on a ``size x size`` matmul,
    over calls that spend about ``min_seconds`` of CPU time after one warm-up. Cached per
    argument set.

    Each call is timed by the calling thread's own CPU clock on one intra-op thread, so the
    time other processes hold the core is not counted: the figure does not depend on the
    load at start-up. A peak is a per-core rate times the cores, as datasheets state it.
    """
    precision = dtype_name(dtype)
    cores = threads if threads is not None else torch.get_num_threads()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the matmul runs on the calling thread, whose clock is read
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator).to(DTYPES[precision])
        b = torch.randn(size, size, generator=generator).to(DTYPES[precision])
        torch.mm(a, b)  # warm-up: first-call allocation and kernel selection
        best = math.inf
        calls, spent = 0, 0.0
        while calls < 2 or spent < min_seconds:
            start = time.thread_time()
            torch.mm(a, b)
            elapsed = time.thread_time() - start
            if elapsed > 0:  # below the clock's resolution: not a measurement
                best = min(best, elapsed)
            spent, calls = spent + elapsed, calls + 1
    finally:
        torch.set_num_threads(previous_threads)
    return cores * 2.0 * size**3 / best
