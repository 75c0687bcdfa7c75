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
* ``env``: ``resolve_master_via_mpi(ClusterEnv.detect())`` on the first placement, then
  torch's view of it: a gloo process group started from that ClusterEnv, a
  (node, local) DeviceMesh built from its ``node_of_rank``, and what all_gather and
  all_reduce over the mesh's groups return.
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
    """A gloo group from ``env`` and the (node, local) mesh of its membership, as a hierarchical all-reduce builds it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from distlm.backends.cpu import CpuBackend
    from distlm.env import ranks_by_node

    CpuBackend().init_process_group(env, datetime.timedelta(seconds=60))
    grid = ranks_by_node(env.node_of_rank)
    mesh = DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=("node", "local"))
    intra, inter = mesh["local"].get_group(), mesh["node"].get_group()
    sums = {}
    for name, group in (("intra", intra), ("inter", inter)):
        value = torch.tensor([float(env.rank)])
        dist.all_reduce(value, group=group)
        sums[name] = value.item()
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "intra_ranks": dist.get_process_group_ranks(intra),
        "inter_ranks": dist.get_process_group_ranks(inter),
        "sums": sums,
    }


def main() -> int:
    from mpi4py import MPI

    from distlm.env import ClusterEnv, mpi_node_layout, resolve_master_via_mpi

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
        env = resolve_master_via_mpi(ClusterEnv.detect(), node_comm=split_by_host(comm, placements[0]))
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
    from distlm.train import exit_without_teardown

    exit_without_teardown(main())
