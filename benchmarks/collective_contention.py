"""A CPU collective alone against the same collective beside a busy compute thread on every rank.

    torchrun --standalone --nproc_per_node 2 benchmarks/collective_contention.py [--sizes-mib 0.25,2,8]

Inside an update, a gloo collective that is issued while its rank still computes (FSDP's
prefetched all-gathers, its reduce-scatters behind the next block's backward, DDP's
early buckets) has its communication thread share the rank's cores with the compute
threads. The planner's collective probe times each collective alone; ``distlm.plan``
slows the ones issued beside compute by the ratio of runnable threads to cores with and
without compute (``collective_slowdown``: 2 for one-thread ranks, one per core). This
measures that ratio: for each size, ``all_gather_into_tensor`` (the size is the gathered
output), ``reduce_scatter_tensor`` and ``all_reduce`` (the size is the input), each
timed alone and with every rank running matrix products on a thread of its own (with
the rank's intra-op threads), rounds interleaved, the slowest rank's time per
call, medians. Rank 0 prints one JSON object with the times and their ratios.

A continuous compute load is the worst case: inside an update the ranks also wait for
each other, and the cores are then free for communication.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

MIB = 1024 * 1024


class BusyCompute:
    """Matrix products on a thread of their own until stopped (torch releases the GIL inside them)."""

    def __init__(self, dim: int = 256):
        self.a, self.b = torch.randn(dim, dim), torch.randn(dim, dim)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            torch.mm(self.a, self.b)

    def __enter__(self) -> "BusyCompute":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def slowest_median(call: Callable[[], object], rounds: int) -> float:
    """Median over ``rounds`` calls (each after a barrier) of the slowest rank's seconds."""
    seconds = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    times = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", default="0.25,2,8", help="buffer sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per collective, size and case")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of alone and beside compute")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = []
    for size_mib in (float(part) for part in args.sizes_mib.split(",")):
        numel = max(world, int(size_mib * MIB) // 4 // world * world)
        full, shard = torch.ones(numel), torch.ones(numel // world)
        calls = {
            "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG),
            "all_reduce": lambda: dist.all_reduce(full),
        }
        for call in calls.values():
            call()
        alone: dict[str, list[float]] = {name: [] for name in calls}
        beside: dict[str, list[float]] = {name: [] for name in calls}
        for repeat in range(args.repeats):
            for case in (("alone", "beside") if repeat % 2 == 0 else ("beside", "alone")):
                for name, call in calls.items():
                    if case == "alone":
                        alone[name].append(slowest_median(call, args.rounds))
                    else:
                        with BusyCompute():
                            time.sleep(0.05)  # the compute thread is running before the first call
                            beside[name].append(slowest_median(call, args.rounds))
        for name in calls:
            a, b = statistics.median(alone[name]), statistics.median(beside[name])
            rows.append({"collective": name, "size_bytes": numel * 4, "alone_s": round(a, 6),
                         "beside_compute_s": round(b, 6), "ratio": round(b / a, 3)})
    if dist.get_rank() == 0:
        print(json.dumps({"benchmark": "collective_contention", "world_size": world,
                          "threads_per_rank": torch.get_num_threads(), "torch": torch.__version__,
                          "rows": rows}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
