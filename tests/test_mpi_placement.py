"""MPI node placement: which ranks share a host, from MPI itself, under ``mpiexec --map-by node``.

``mpiexec --map-by node`` places ranks round-robin over the hosts, so rank // ranks-per-node
is not the node. One machine is one host, so 2 hosts are simulated (the worker splits
COMM_WORLD by a named host per rank, tests/mpi_placement_worker.py); the layout code,
``resolve_master_via_mpi`` and torch's process groups built from the result are the real
ones. Skips, with the reason shown by ``-ra``, where mpiexec or mpi4py is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

MPIEXEC = shutil.which("mpiexec")
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
WORKER = Path(__file__).with_name("mpi_placement_worker.py")
# A run takes about 3 s here; past this it is hung.
SUBPROCESS_TIMEOUT = 120
# Round-robin (what --map-by node does with 2 hosts), then host names that sort against
# rank order, then an uneven placement.
PLACEMENTS = [["a", "b", "a", "b"], ["z", "y", "y", "z"], ["a", "b", "b", "b"]]


def expected_layout(rank: int, hosts: list[str]) -> dict:
    """Nodes numbered by their lowest rank; local rank is the position among the host's ranks."""
    first_rank = {host: hosts.index(host) for host in hosts}
    nodes = sorted(set(hosts), key=first_rank.__getitem__)
    mates = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return {
        "node_rank": nodes.index(hosts[rank]),
        "num_nodes": len(nodes),
        "local_rank": mates.index(rank),
        "local_world_size": len(mates),
        "node_of_rank": [nodes.index(host) for host in hosts],
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    if MPIEXEC is None or not HAVE_MPI4PY:
        pytest.skip(
            "mpiexec not found (apt-get install openmpi-bin libopenmpi-dev)"
            if MPIEXEC is None
            else "mpi4py not installed (pip install 'distlm[mpi]')"
        )
    out_dir = tmp_path_factory.mktemp("placement")
    size = len(PLACEMENTS[0])
    command = [
        MPIEXEC, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--map-by", "node",
        "-n", str(size), sys.executable, str(WORKER), str(out_dir), *(",".join(hosts) for hosts in PLACEMENTS),
    ]
    # conftest.py already removed every launcher variable from os.environ.
    proc = subprocess.Popen(
        command, cwd=out_dir, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"mpiexec -n {size} did not finish in {SUBPROCESS_TIMEOUT} s:\n{err[-4000:]}")
    errors = [f"{p.name}:\n{p.read_text()}" for p in sorted(out_dir.glob("*.error"))]
    assert not errors and proc.returncode == 0, "\n".join(errors) or err[-4000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(size)]


def test_every_rank_finds_the_same_membership_for_each_placement(results):
    for index, hosts in enumerate(PLACEMENTS):
        for result in results:
            assert result["simulated"][index] == expected_layout(result["rank"], hosts), (hosts, result["rank"])


def test_the_real_split_sees_this_machine_as_one_host(results):
    # All ranks run here: one node, and MPI's local ranks are the ones OpenMPI exported.
    for result in results:
        real = result["real"]
        assert real["node_of_rank"] == [0] * result["size"]
        assert [real["local_rank"], real["local_world_size"]] == result["ompi_local"]


def test_resolve_master_via_mpi_fills_in_the_nodes_of_a_round_robin_placement(results):
    hosts = PLACEMENTS[0]
    masters = {(r["env"]["master_addr"], r["env"]["master_port"]) for r in results}
    assert len(masters) == 1  # one master, agreed through MPI
    for result in results:
        env = result["env"]
        assert (env["launcher"], env["rank"], env["world_size"]) == ("mpi", result["rank"], len(hosts))
        layout = expected_layout(result["rank"], hosts)
        assert {name: env[name] for name in layout} == layout


def test_torch_groups_built_from_the_membership_hold_the_ranks_of_each_host(results):
    """A (node, local) mesh from node_of_rank, as the hierarchical all-reduce builds it, on gloo."""
    hosts = PLACEMENTS[0]
    for result in results:
        torch_view, rank = result["torch"], result["rank"]
        # torch's ranks are MPI's, and torch's processes sit on the hosts MPI placed.
        assert (torch_view["rank"], torch_view["world_size"]) == (rank, len(hosts))
        assert torch_view["hosts"] == hosts
        same_host = [r for r, host in enumerate(hosts) if host == hosts[rank]]
        local_index = same_host.index(rank)
        same_local_index = [
            [r for r, host in enumerate(hosts) if host == node][local_index]
            for node in sorted(set(hosts), key=hosts.index)
        ]
        assert torch_view["intra_ranks"] == same_host
        assert torch_view["inter_ranks"] == same_local_index
        assert torch_view["sums"] == {"intra": float(sum(same_host)), "inter": float(sum(same_local_index))}
