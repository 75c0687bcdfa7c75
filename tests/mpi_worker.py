"""Programs that tests/test_mpi.py runs under ``mpiexec -n N python tests/mpi_worker.py JOB OUT_DIR``.

Each rank writes ``OUT_DIR/rank{R}.json`` (or ``rank{R}.error`` with its traceback), and
the test reads them. Run by hand the same way, e.g.

    mpiexec --allow-run-as-root -n 2 python tests/mpi_worker.py transport /tmp/out

FLOOD: on OpenMPI 4.1.4 with its shared-memory BTL's CMA single copy, a few hundred
outstanding Iallreduces of more than 4 KiB each left gloo's next collective in the same
process hung; distlm/parallel/mpi_transport.py caps the requests in flight, and
``job_ddp_hook`` floods it with 1000 and then runs a gloo barrier.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

# (name, dtype, numel): several dtypes and sizes, odd ones included, issued back to back.
TRANSPORT_CASES = [
    ("fp32_small", torch.float32, 1),
    ("fp32_odd", torch.float32, 1000003),
    ("fp16", torch.float16, 262147),
    ("bf16", torch.bfloat16, 262147),
    ("fp64", torch.float64, 4099),
    ("int64", torch.int64, 17),
    ("fp32_large", torch.float32, 4 * 1024 * 1024 + 5),
    ("fp32_empty", torch.float32, 0),
]
COMPLETION_TIMEOUT = 60.0
FLOOD_REQUESTS, FLOOD_NUMEL = 1000, 1024


def rank_data(case: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The tensor rank ``rank`` contributes to case ``case``; every rank can compute every rank's."""
    rng = np.random.default_rng(1000 * case + rank)
    if dtype.is_floating_point:
        # Mixed magnitudes so half-precision sums round; within fp16 range so nothing overflows.
        values = rng.standard_normal(numel) * np.exp2(rng.integers(-10, 10, numel))
        return torch.from_numpy(values).to(dtype)
    return torch.from_numpy(rng.integers(-(2**40), 2**40, numel)).to(dtype)


def expected_sum(case: int, size: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Left-to-right sum in the tensor's own dtype: for 2 ranks, the one rounding MPI does too."""
    total = rank_data(case, 0, dtype, numel).clone()
    for rank in range(1, size):
        total += rank_data(case, rank, dtype, numel)
    return total


def job_transport(nonblocking: bool = False) -> dict:
    """Back-to-back all_reduce_sum calls from this thread; the futures complete on the transport's."""
    from mpi4py import MPI

    from distlm.parallel.mpi_transport import MPITransport, mpi_comm_for_ranks, split_by_local_rank

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    transport = MPITransport(mpi_comm_for_ranks(range(size), world), nonblocking=nonblocking)
    tensors = [rank_data(i, rank, dtype, n) for i, (_, dtype, n) in enumerate(TRANSPORT_CASES)]
    completion_order: list[int] = []
    callback_threads: set[str] = set()
    lock = threading.Lock()

    def on_done(index):
        def callback(fut):
            with lock:
                completion_order.append(index)
                callback_threads.add(threading.current_thread().name)
            return fut.value()

        return callback

    world.Barrier()  # everything before this point may touch MPI from the main thread
    started = time.perf_counter()
    futures = [transport.all_reduce_sum(t) for t in tensors]
    issue_seconds = time.perf_counter() - started
    chained = [fut.then(on_done(i)) for i, fut in enumerate(futures)]
    # Never wait() or call MPI here: only the transport's thread can complete the requests.
    deadline = time.monotonic() + COMPLETION_TIMEOUT
    while not all(f.done() for f in chained) and time.monotonic() < deadline:
        time.sleep(0.005)
    completed = all(f.done() for f in chained)
    results = {}
    for i, ((name, dtype, numel), fut) in enumerate(zip(TRANSPORT_CASES, futures)):
        if not fut.done():
            results[name] = "not completed"
            continue
        value = fut.value()
        expected = expected_sum(i, size, dtype, numel)
        results[name] = {
            "same_tensor": value is tensors[i],
            "equal": bool(torch.equal(value, expected)),
            "max_abs_diff": float((value.double() - expected.double()).abs().max()) if numel else 0.0,
        }
    transport.close()
    try:
        transport.all_reduce_sum(torch.zeros(3))
        after_close = "accepted"
    except RuntimeError as err:
        after_close = str(err)

    # A one-rank communicator (this rank's inter-node peers when all ranks share a node)
    # completes without any MPI traffic.
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    inter = split_by_local_rank(world, local_rank)
    solo = MPITransport(inter)
    one = torch.arange(4.0)
    solo_value = solo.all_reduce_sum(one).wait()
    solo.close()
    return {
        "rank": rank,
        "size": size,
        "thread_level": MPI.Query_thread(),
        "completed": completed,
        "issue_seconds": issue_seconds,
        "completion_order": completion_order,
        "callback_threads": sorted(callback_threads),
        "main_thread": threading.current_thread().name,
        "results": results,
        "after_close": after_close,
        "inter_size": inter.Get_size(),
        "solo_unchanged": bool(torch.equal(solo_value, torch.arange(4.0))),
    }


def _init_gloo() -> None:
    """A gloo process group under mpiexec, its master agreed through mpi4py (as the Trainer does)."""
    import datetime

    from distlm.backends.cpu import CpuBackend
    from distlm.launch.detect import detect_launch
    from distlm.launch.mpi import resolve_master_via_mpi

    env = resolve_master_via_mpi(detect_launch())
    CpuBackend().init_process_group(env, datetime.timedelta(seconds=60))


def job_ddp_hook() -> dict:
    """A small DDP model with comm_hooks' allreduce reducer over MPITransport, against DDP's own gloo all-reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distlm.parallel import comm_hooks
    from distlm.parallel.ddp import ddp_hook
    from distlm.parallel.mpi_transport import mpi_transport_factory

    _init_gloo()
    rank = dist.get_rank()
    # Non-blocking: the flood below must pass through the in-flight cap.
    transport = mpi_transport_factory("cpu", nonblocking=True)(None)

    # A flood of small requests, as a model with many small buckets makes, then gloo
    # traffic: without the transport's in-flight cap, 1000 outstanding Iallreduces of 4 KiB
    # on OpenMPI 4.1's shared memory left the gloo barrier below hung (FLOOD in the module doc).
    flood = [torch.full((FLOOD_NUMEL,), float(rank + i)) for i in range(FLOOD_REQUESTS)]
    futures = [transport.all_reduce_sum(t) for t in flood]
    flood_ok = all(bool((f.wait() == float(2 * i + 1)).all()) for i, f in enumerate(futures))
    dist.barrier()

    def make_model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        layers = []
        for _ in range(6):
            layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers)

    params = {}
    buckets_seen = {}
    for name in ("gloo", "mpi"):
        ddp = DistributedDataParallel(make_model(0), bucket_cap_mb=0.02)  # 16 KB buckets: several per step
        if name == "mpi":
            hook = ddp_hook(comm_hooks.allreduce_reducer(transport))
            seen: set[int] = set()

            def counting_hook(state, bucket, hook=hook, seen=seen):
                seen.add(bucket.index())
                return hook(state, bucket)

            ddp.register_comm_hook(None, counting_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(16, 64, generator=gen)
            ddp(x).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        params[name] = [p.detach().clone() for p in ddp.module.parameters()]
        if name == "mpi":
            buckets_seen[name] = len(seen)
    transport.close()
    return {
        "rank": rank,
        "flood_ok": flood_ok,
        "buckets": buckets_seen["mpi"],
        "max_diff_vs_gloo": max(float((a - b).abs().max()) for a, b in zip(params["mpi"], params["gloo"])),
        "digest": [float(p.double().sum()) for p in params["mpi"]],
    }


def job_hierarchical() -> dict:
    """comm_hooks' hierarchical reducers with the inter-node leg over MPI and over gloo, same inputs.

    Run on 4 ranks as 2 simulated nodes of 2: the inter-node communicators are MPI
    sub-communicators built from torch's inter-node process groups.
    """
    import torch.distributed as dist

    from distlm.mesh import ParallelDims
    from distlm.parallel import comm_hooks
    from distlm.parallel.ddp import ddp_hook
    from distlm.parallel.mpi_transport import mpi_transport_factory

    _init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    mpi_factory = mpi_transport_factory("cpu")
    results = {}
    for kind in ("hierarchical", "hierarchical-fp16"):
        reducers = {
            name: comm_hooks.build_reducer(
                kind, None, dims=ParallelDims(world_size=world, ranks_per_node=2), device_type="cpu",
                inter_transport_factory=factory,
            )
            for name, factory in (("mpi", mpi_factory), ("gloo", None))
        }
        for numel in (1, 1001, 65536):  # 1001: not a multiple of the node size
            inputs = rank_data(numel, rank, torch.float32, numel)
            out = {name: reducer(inputs.clone()).wait() for name, reducer in reducers.items()}
            mean = sum(rank_data(numel, r, torch.float32, numel).double() for r in range(world)) / world
            results[f"{kind}/{numel}"] = {
                "equal": bool(torch.equal(out["mpi"], out["gloo"])),
                "max_abs_diff": float((out["mpi"] - out["gloo"]).abs().max()),
                # Sanity: both are the mean, not the same wrong answer.
                "relative_error": float((out["mpi"].double() - mean).abs().max() / mean.abs().max()),
            }
    return {"rank": rank, "results": results}


def job_two_ranks() -> dict:
    """The transport on its own, then under DDP: one mpiexec start-up for both."""
    return {
        "transport": job_transport(nonblocking=False),
        "transport_nonblocking": job_transport(nonblocking=True),
        "ddp_hook": job_ddp_hook(),
    }


JOBS = {"transport": job_transport, "ddp_hook": job_ddp_hook, "hierarchical": job_hierarchical, "two_ranks": job_two_ranks}


def main() -> int:
    job, out_dir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    try:
        result = JOBS[job]()
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        status = 0
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        status = 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return status


if __name__ == "__main__":
    from distlm.errors import exit_without_teardown

    exit_without_teardown(main())
