"""Gradient all-reduce algorithms, bucketing, and gloo against MPI, timed interleaved.

    torchrun --nproc_per_node 2 benchmarks/allreduce.py [--quick]
    mpiexec --allow-run-as-root -n 2 python benchmarks/allreduce.py [--quick]

Under either launcher, for fp32 buffers of 64 KiB to 256 MiB (powers of 4):

* ``collectives``: distlm's reducers (parallel/comm_hooks.py) over the process group --
  plain, fp16, hierarchical and hierarchical-fp16 all-reduce (averaging, as DDP needs);
* ``bucketing``: 1000 tensors of 4 KiB all-reduced one by one (issued back to back, then
  waited) against the same bytes flattened into one buffer, all-reduced, copied back.

Under mpiexec also:

* ``transports``: the same plain and fp16 reducers with the flat leg over gloo and over
  MPI (``MPITransport``: ``/mpi`` its default blocking Allreduce on the transport's
  thread, ``/mpi-nb`` Iallreduce), and per-parameter vs bucketed over MPI; the gloo group
  is started with the master agreed through mpi4py, as the Trainer does.

Timing: every contender of one size runs once per round, in an order rotated each round,
after a barrier; a call's time is the slowest rank's. Reported: the median over rounds,
algorithm bandwidth (fp32 bytes / time, also for the half-precision reducers: it is the
gradient payload that matters) and bus bandwidth as nccl-tests define it for
all-reduce, busbw = algbw * 2(n-1)/n. Ratios are ratios of medians. The host is noisy
(2 shared cores), so compare ratios from one run, not absolute numbers between runs.
Rank 0 prints one JSON object (and writes it to --out if given).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from distlm.backends.cpu import CpuBackend
from distlm.launch.detect import detect_launch
from distlm.launch.mpi import resolve_master_via_mpi
from distlm.mesh import ParallelDims
from distlm.parallel import comm_hooks
from distlm.errors import exit_without_teardown

KIB, MIB = 1024, 1024 * 1024
FULL_SIZES = [64 * KIB * 4**i for i in range(7)]  # 64 KiB ... 256 MiB
QUICK_SIZES = [64 * KIB, 1 * MIB, 16 * MIB]
METHODS = ("plain", "fp16", "hierarchical", "hierarchical-fp16")
KIND_OF = {"plain": "allreduce", "fp16": "fp16", "hierarchical": "hierarchical", "hierarchical-fp16": "hierarchical-fp16"}


def rounds_for(size: int, quick: bool) -> int:
    """More rounds where calls are short and noisy, few where one call takes 0.1-0.5 s."""
    if quick:
        return 7 if size <= MIB else 4
    if size <= MIB:
        return 25
    if size <= 16 * MIB:
        return 11
    return 5 if size <= 64 * MIB else 3


def slowest_rank(seconds: list[float]) -> list[float]:
    """Per-call time of the slowest rank (one all-reduce of all timings, outside the timed region)."""
    times = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def interleaved(contenders: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per contender; one warm-up call each, then ``rounds`` rotated rounds."""
    names = list(contenders)
    for name in names:
        contenders[name]()
    timings: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            contenders[name]()
            timings[name].append(time.perf_counter() - start)
    return {name: statistics.median(slowest_rank(values)) for name, values in timings.items()}


def bandwidth(size: int, seconds: float, world: int) -> dict[str, float]:
    algbw = size / seconds / 1e9
    return {"algbw_GBps": round(algbw, 3), "busbw_GBps": round(algbw * 2 * (world - 1) / world, 3)}


def reducer_call(reducer, buffer: torch.Tensor) -> Callable[[], None]:
    # The reducers average in place; with every rank's buffer equal after the first call
    # the values stay put (x/n summed n times), so repeated calls never overflow fp16.
    return lambda: reducer(buffer).wait()


def bench_collectives(sizes, quick, ranks_per_node, factory=None, methods=METHODS, label=""):
    world = dist.get_world_size()
    reducers = {
        m: comm_hooks.build_reducer(
            KIND_OF[m], None, dims=ParallelDims(world_size=world, ranks_per_node=ranks_per_node), device_type="cpu",
            inter_transport_factory=factory,
        )
        for m in methods
    }
    rows = []
    for size in sizes:
        torch.manual_seed(dist.get_rank())
        buffers = {m: torch.randn(size // 4) for m in methods}
        medians = interleaved({m: reducer_call(reducers[m], buffers[m]) for m in methods}, rounds_for(size, quick))
        for m in methods:
            rows.append({"size_bytes": size, "method": m + label, "median_s": round(medians[m], 6),
                         **bandwidth(size, medians[m], world)})
        del buffers
    return rows


def bench_bucketing(quick, transport_factory=None, label="gloo"):
    """1000 x 4 KiB tensors: one all-reduce each (issued together, then waited) vs one flat buffer."""
    count, numel = 1000, 1024
    transport = (transport_factory or comm_hooks.TorchTransport)(None)
    torch.manual_seed(dist.get_rank())
    tensors = [torch.randn(numel) for _ in range(count)]

    def per_parameter():
        futures = [transport.all_reduce_sum(t) for t in tensors]
        for f in futures:
            f.wait()

    def bucketed():
        flat = torch.cat(tensors)
        transport.all_reduce_sum(flat).wait()
        for t, piece in zip(tensors, flat.split(numel)):
            t.copy_(piece)

    # Sums grow by 2x per call: rescale between calls would cost time; fp32 has range to spare.
    medians = interleaved({"per_parameter": per_parameter, "bucketed": bucketed}, 5 if quick else 15)
    return {
        "transport": label, "tensors": count, "bytes_each": numel * 4,
        "per_parameter_s": round(medians["per_parameter"], 6), "bucketed_s": round(medians["bucketed"], 6),
        "bucketed_speedup": round(medians["per_parameter"] / medians["bucketed"], 2),
    }


def ratio_rows(rows, numerator: str, denominator: str, min_size: int = 0) -> dict[str, float]:
    by = {(r["size_bytes"], r["method"]): r["median_s"] for r in rows}
    out = {}
    for (size, method), seconds in sorted(by.items()):
        if method == numerator and size >= min_size and (size, denominator) in by:
            out[str(size)] = round(seconds / by[(size, denominator)], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~20 s smoke run: 3 sizes up to 16 MiB, few rounds")
    parser.add_argument("--max-size-mib", type=float, default=None, help="largest buffer (default 256, quick 16)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="node size for the hierarchical reducers (default: the launcher's local world size)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    env = detect_launch()
    if env.world_size < 2:
        sys.exit("run under torchrun --nproc_per_node 2 or mpiexec -n 2: an all-reduce needs at least 2 ranks")
    if env.launcher == "mpi":
        env = resolve_master_via_mpi(env)
    CpuBackend().init_process_group(env, datetime.timedelta(seconds=600))
    world = dist.get_world_size()
    ranks_per_node = args.ranks_per_node or env.local_world_size
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.max_size_mib is not None:
        sizes = [s for s in FULL_SIZES if s <= args.max_size_mib * MIB]
    started = time.perf_counter()

    collectives = bench_collectives(sizes, args.quick, ranks_per_node)
    bucketing = [bench_bucketing(args.quick)]
    report = {
        "benchmark": "allreduce",
        "launcher": env.launcher,
        "world_size": world,
        "ranks_per_node": ranks_per_node,
        "torch": torch.__version__,
        "quick": args.quick,
        "collectives": collectives,
        "bucketing": bucketing,
    }
    summary = {
        "fp16_over_plain_time": ratio_rows(collectives, "fp16", "plain"),
        "fp16_over_plain_time_median_ge_4MiB": None,
        "hierarchical_over_plain_time": ratio_rows(collectives, "hierarchical", "plain"),
        "hierarchical_fp16_over_plain_time": ratio_rows(collectives, "hierarchical-fp16", "plain"),
        "bucketed_speedup_gloo": bucketing[0]["bucketed_speedup"],
    }
    big = list(ratio_rows(collectives, "fp16", "plain", 4 * MIB).values())
    summary["fp16_over_plain_time_median_ge_4MiB"] = round(statistics.median(big), 3) if big else None

    if env.launcher == "mpi":
        from distlm.parallel.mpi_transport import mpi_transport_factory

        mpi_factory = mpi_transport_factory("cpu")
        mpi_nonblocking = mpi_transport_factory("cpu", nonblocking=True)
        # Same reducers, same sizes; the flat leg over gloo and over MPI, interleaved.
        # mpi: the transport's default (blocking Allreduce on its thread); mpi-nb: Iallreduce.
        rows = []
        world_reducers = {}
        simulated_nodes = ParallelDims(world_size=dist.get_world_size(), ranks_per_node=ranks_per_node)
        for method, label, factory in (
            ("plain", "/gloo", None), ("plain", "/mpi", mpi_factory), ("plain", "/mpi-nb", mpi_nonblocking),
            ("fp16", "/gloo", None), ("fp16", "/mpi", mpi_factory),
        ):
            world_reducers[method + label] = comm_hooks.build_reducer(
                KIND_OF[method], None, dims=simulated_nodes, device_type="cpu", inter_transport_factory=factory,
            )
        for size in sizes:
            torch.manual_seed(dist.get_rank())
            buffers = {name: torch.randn(size // 4) for name in world_reducers}
            medians = interleaved({n: reducer_call(r, buffers[n]) for n, r in world_reducers.items()},
                                  rounds_for(size, args.quick))
            for name in world_reducers:
                rows.append({"size_bytes": size, "method": name, "median_s": round(medians[name], 6),
                             **bandwidth(size, medians[name], world)})
            del buffers
        report["transports"] = rows
        bucketing.append(bench_bucketing(args.quick, mpi_factory, label="mpi"))
        summary["mpi_over_gloo_time_plain"] = ratio_rows(rows, "plain/mpi", "plain/gloo")
        summary["mpi_iallreduce_over_allreduce_time"] = ratio_rows(rows, "plain/mpi-nb", "plain/mpi")
        summary["mpi_over_gloo_time_fp16"] = ratio_rows(rows, "fp16/mpi", "fp16/gloo")
        summary["bucketed_speedup_mpi"] = bucketing[1]["bucketed_speedup"]

    report["summary"] = summary
    report["wall_s"] = round(time.perf_counter() - started, 1)
    if dist.get_rank() == 0:
        text = json.dumps(report, indent=2)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # gloo threads may outlive main(); see its docstring
