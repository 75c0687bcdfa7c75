"""torchtitan's own trainer on CPU over gloo, for comparisons; run with torchtitan's interpreter.

    torchrun --standalone --nproc_per_node 2 benchmarks/torchtitan_cpu.py --module llama3 \
        --config llama3_debugmodel --parallelism.spmd-backend partial_dtensor ...

torchtitan is never a dependency of distlm: this script runs in a virtual environment of its
own (torch==2.13.0, torchtitan==0.3.0, triton). Its arguments are torchtitan's command line.
torchtitan 0.3.0 assumes an accelerator in a few places; each change below is the least that
lets its trainer run unchanged otherwise, and says why it is needed. ``--parallelism.spmd-backend
partial_dtensor`` is also needed at 2 ranks: the default backend wants every parameter a DTensor
before FSDP, which on CPU it is not.
"""

from __future__ import annotations

import resource
from datetime import timedelta
from typing import Any

import torch
import torch._utils
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def answer_cpu_as_the_device() -> None:
    """torchtitan asks torch for the available accelerator and falls back to "cuda"; asked
    before torchtitan is imported, the answer "cpu" gives it ``torch.cpu`` as its device module."""
    torch._utils._get_available_device_type = lambda: "cpu"


def patch_torchtitan() -> None:
    """Replace, inside torchtitan's modules, the few pieces that assume an accelerator (each says why)."""
    from torchtitan.components import metrics
    from torchtitan.distributed import fsdp
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models import llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    class CpuMemoryMonitor:
        """The device memory monitor reads CUDA's allocator statistics; on CPU, the process's peak RSS."""

        device_name = "cpu"

        def get_peak_stats(self) -> Any:
            gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
            return metrics.DeviceMemStats(gib, 0.0, gib, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor

    # Flex attention has no backward on CPU in torch 2.13. SDPA is the causal attention
    # torchtitan itself runs maskless (no per-document masks are built for it).
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()

    original_fully_shard = fsdp.fully_shard

    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        """gloo has no PREMUL_SUM: FSDP must reduce with plain sums and scale apart."""
        sharded = original_fully_shard(module, *args, **kwargs)
        for part in sharded if isinstance(sharded, list) else [sharded]:
            part.set_force_sum_reduction_for_comms(True)
        return sharded

    fsdp.fully_shard = fully_shard

    def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
        """After step 1 torchtitan barriers on a device index and calls a timeout setter that
        torch 2.13 names ``_set_pg_timeout``."""
        dist.barrier()
        groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
        for group in [*groups, None]:
            c10d._set_pg_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


def main() -> None:
    """torchtitan's own ``main`` with its command line, after the patches."""
    answer_cpu_as_the_device()
    patch_torchtitan()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
