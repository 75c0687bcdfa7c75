"""What tests/test_mpi_placement.py runs under ``mpiexec -n N --map-by node``.

    mpiexec --allow-run-as-root --oversubscribe --map-by node -n 4 \
        python tests/mpi_placement_worker.py OUT_DIR a,b,a,b [z,y,y,z ...]

Each argument after OUT_DIR names a (simulated) host for every rank, in rank order. One
machine puts every rank on one host, so hosts are simulated by splitting COMM_WORLD by
the named host (``comm.Split(color=host)``) and handing that communicator to the layout
code in place of its shared-memory split. Every rank writes ``OUT_DIR/rank{R}.json`` (or
``rank{R}.error`` with its traceback):

* ``real``: ``mpi_node_layout(COMM_WORLD)`` with MPI's own split of this machine, and
  the local rank and size OpenMPI exported, to compare;
* ``simulated``: the layout for each named placement;
* ``env``: ``resolve_master_via_mpi(detect_launch())`` on the first placement, then
  torch's view of it: a gloo process group started from that ClusterEnv, the hierarchical
  all-reduce training builds from the membership it found (the start's gathering of every
  rank's host and node into the dims' node axis, the builder's options,
  ``comm_hooks.build_reducer``), its intra- and inter-node groups,
  and what all_gather, all_reduce over those groups and the reducer itself return.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import traceback
from pathlib import Path


def split_by_host(comm, hosts: list[str]):
    """The communicator of the ranks that ``hosts`` puts on this rank's host, in world-rank order."""
    rank = comm.Get_rank()
    return comm.Split(color=sorted(set(hosts)).index(hosts[rank]), key=rank)


def torch_view(env) -> dict:
    """A gloo group from ``env``, and the hierarchical all-reduce training builds on it: the
    membership through the start's gathering (``place_ranks_by_hosts``) into the dims' node axis
    and the builder's options, the reducer from ``comm_hooks.build_reducer``; its groups, and
    what it and all_reduce over them return."""
    import torch
    import torch.distributed as dist

    from distlm.backends.cpu import CpuBackend
    from distlm.training.builder import parallel_options
    from distlm.config import parse_args
    from distlm.runtime.context import DistContext
    from distlm.runtime.process_group import place_ranks_by_hosts
    from distlm.mesh import ParallelDims
    from distlm.parallel import comm_hooks

    backend, timeout = CpuBackend(), datetime.timedelta(seconds=60)
    backend.init_process_group(env, timeout)
    env, node_of_rank, _ = place_ranks_by_hosts(env)
    ctx = DistContext(env=env, backend=backend, device=torch.device("cpu"),
                      dims=ParallelDims(env.world_size).on_nodes(node_of_rank), timeout=timeout)
    options = parallel_options(parse_args(["--comm-hook", "hierarchical", "--device", "cpu"]), ctx)
    reducer = comm_hooks.build_reducer(options.layout.comm_hook, ctx.dp_group, dims=ctx.dims, device_type="cpu")
    intra, inter = reducer.intra_group, reducer.inter.group
    sums = {}
    for name, group in (("intra", intra), ("inter", inter)):
        value = torch.tensor([float(env.rank)])
        dist.all_reduce(value, group=group)
        sums[name] = value.item()
    # The reducer's result against the mean of every rank's values; 1001 elements is not a
    # multiple of the ranks per node, so the padded path runs too.
    values = lambda rank: torch.arange(1001, dtype=torch.float32) * (rank + 1)  # noqa: E731
    reduced = reducer(values(env.rank)).wait()
    mean = sum(values(rank).double() for rank in range(env.world_size)) / env.world_size
    error = float((reduced.double() - mean).abs().max() / mean.abs().max())
    if error > 1e-6:  # fp32 rounding of a 4-term mean; reported through rank{R}.error
        raise AssertionError(f"{reducer!r} returned a mean off by {error:.3g} (relative)")
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "reducer": repr(reducer),
        "intra_ranks": dist.get_process_group_ranks(intra),
        "inter_ranks": dist.get_process_group_ranks(inter),
        "sums": sums,
        "mean_relative_error": error,
    }


def main() -> int:
    from mpi4py import MPI

    from distlm.launch.detect import detect_launch
    from distlm.launch.mpi import mpi_node_layout, resolve_master_via_mpi

    out_dir, placements = Path(sys.argv[1]), [p.split(",") for p in sys.argv[2:]]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        result = {
            "rank": rank,
            "size": comm.Get_size(),
            "ompi_local": [int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]), int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])],
            "real": mpi_node_layout(comm)._asdict(),
            "simulated": [mpi_node_layout(comm, split_by_host(comm, hosts))._asdict() for hosts in placements],
        }
        env = resolve_master_via_mpi(detect_launch(), node_comm=split_by_host(comm, placements[0]))
        result["env"] = dataclasses.asdict(env)
        # Each rank's simulated host, as torch's process group sees the ranks.
        result["torch"] = torch_view(env)
        import torch.distributed as dist

        hosts_seen = [None] * env.world_size
        dist.all_gather_object(hosts_seen, placements[0][rank])
        result["torch"]["hosts"] = hosts_seen
        dist.barrier()
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        return 0
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        return 1


if __name__ == "__main__":
    from distlm.errors import exit_without_teardown

    exit_without_teardown(main())
