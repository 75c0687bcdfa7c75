"""Runs across two simulated nodes (tests/cluster.py) train the same model as one node.

Every launcher distlm supports for several machines starts ranks inside two network
namespaces that reach each other over a bridge, as two hosts on a network would: torchrun
with c10d rendezvous (2 nodes x 1 rank under FSDP, 2 x 2 under the hierarchical hook),
torchrun's static ``--node-rank`` (tensor parallel 2 x data parallel 2, tensor parallel
inside each node), fairseq's ``--distributed-init-method tcp://`` with 2 processes per
host, and ``mpiexec`` with a hostfile whose rsh agent enters the node's namespace instead
of ssh. Each saves a checkpoint whose weights must equal, bit for bit, those of the same
layout at the same world size on one node (this host, through the test harness): gloo
sums in the same order whichever network carries the bytes, and the hierarchical
reference simulates 2 nodes of 2 with ``--ranks-per-node 2``, the grouping the real
nodes must produce.

fairseq's launch says nothing about which ranks share a host; distlm must find 2 nodes x
2 ranks from the hosts themselves (a 4 x 1 guess groups and sums differently).

One cluster serves the module, runs go one after another (at most 4 training processes on
this machine's 2 cores), and the one-node references are computed once. About 2 min on an
idle machine, twice that when other jobs share its cores.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import Cluster, kill_session, require_cluster
from conftest import LAUNCHER_VARIABLES
from distributed import Scenarios
from test_launch import args_for, assert_models_identical, fit, last_checkpoint

pytestmark = pytest.mark.cluster

UPDATES = 3
BATCH = 2  # per rank
# A 2-node run of the tiny model takes 15-20 s here; past this it is hung.
RUN_TIMEOUT = 240
HIERARCHICAL = ["--comm-hook", "hierarchical"]
TP2 = ["--tp-degree", "2"]
FSDP = ["--strategy", "fsdp"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = ["-m", "distlm.train"]


@pytest.fixture(scope="module")
def cluster():
    require_cluster()
    with Cluster(nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def one_node(cluster, data_dir, tmp_path_factory) -> dict[str, dict]:
    """Each layout's weights at the same world size on one node: 4 ranks (2 simulated nodes
    of 2 for the hierarchical hook; tensor parallel 2) in one job, and 2 ranks under FSDP."""
    root = tmp_path_factory.mktemp("one_node")
    layouts = {"hierarchical": (4, HIERARCHICAL + ["--ranks-per-node", "2"]), "tp": (4, TP2), "fsdp": (2, FSDP)}
    jobs = {}
    for world in (4, 2):
        scenarios = [(name, fit, (args_for(data_dir, root / name, UPDATES, BATCH, extra),))
                     for name, (size, extra) in layouts.items() if size == world]
        jobs[world] = Scenarios(world, scenarios, timeout=RUN_TIMEOUT)
    references = {}
    for name, (world, _) in layouts.items():
        jobs[world][name]  # fails the test that needs it, with the rank's traceback
        references[name] = last_checkpoint(root / name)
    return references


def environment() -> dict[str, str]:
    """This process's environment minus any launcher's variables (conftest removes them only
    around each test, after module fixtures start)."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}, "OMP_NUM_THREADS": "1"}


def run_on_nodes(cluster: Cluster, commands: list[tuple[int, list[str]]], cwd: Path) -> str:
    """Start each (node, argv) at once, wait for all; every one must exit 0. Returns their
    stderr together (the log: whichever process holds rank 0 prints its lines there)."""
    procs = [cluster.popen(node, argv, env=environment(), cwd=cwd) for node, argv in commands]
    deadline = time.monotonic() + RUN_TIMEOUT
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_session(proc)
        pytest.fail(f"a run on the cluster did not finish within {RUN_TIMEOUT} s: {commands}")
    for (node, argv), proc, (_, err) in zip(commands, procs, outputs):
        assert proc.returncode == 0, f"{' '.join(argv[:8])} ... on node {node} exited {proc.returncode}:\n{err[-4000:]}"
    return "\n".join(err for _, err in outputs)


def assert_equals_one_node(save_dir: Path, reference: dict) -> None:
    trained = last_checkpoint(save_dir)
    assert trained["world_size"] == reference["world_size"]
    assert trained["num_updates"] == reference["num_updates"] == UPDATES
    assert trained["consumed_samples"] == reference["consumed_samples"]
    assert_models_identical(trained["model"], reference["model"])


def rank0_line(log: str) -> str:
    lines = [line for line in log.splitlines() if "| distlm | launcher " in line]
    assert len(lines) == 1, log[-4000:]
    return lines[0]


def test_torchrun_c10d_two_nodes_of_one_rank_under_fsdp_equal_one_node(cluster, one_node, data_dir, tmp_path):
    save_dir = tmp_path / "run"
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"{cluster.hostname(0)}:29400", "--rdzv-id", "fsdp"]
    command = [*TORCHRUN, *rendezvous, *TRAIN, *args_for(data_dir, save_dir, UPDATES, BATCH, FSDP)]
    log = run_on_nodes(cluster, [(0, command), (1, command)], tmp_path)
    assert "local rank 0 of 1 on node 0 of 2" in rank0_line(log)
    assert "2 nodes from launcher torchelastic, on 2 hosts" in log  # which agent is node 0: the rendezvous decides
    assert_equals_one_node(save_dir, one_node["fsdp"])


def test_torchrun_c10d_two_nodes_of_two_under_the_hierarchical_hook_equal_one_node(cluster, one_node, data_dir,
                                                                                   tmp_path):
    save_dir = tmp_path / "run"
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"{cluster.hostname(0)}:29401", "--rdzv-id", "hierarchical"]
    command = [*TORCHRUN, *rendezvous, *TRAIN, *args_for(data_dir, save_dir, UPDATES, BATCH, HIERARCHICAL)]
    log = run_on_nodes(cluster, [(0, command), (1, command)], tmp_path)
    assert "local rank 0 of 2 on node 0 of 2" in rank0_line(log)
    assert "(hierarchical allreduce over 2 nodes x 2 ranks)" in log
    assert_equals_one_node(save_dir, one_node["hierarchical"])


def test_torchrun_static_node_rank_tensor_parallel_inside_nodes_equals_one_node(cluster, one_node, data_dir,
                                                                                tmp_path):
    # Ranks 0-1 (node0) and 2-3 (node1) each hold one replica's tensor-parallel shards;
    # the data-parallel all-reduce crosses the network.
    save_dir = tmp_path / "run"
    args = args_for(data_dir, save_dir, UPDATES, BATCH, TP2)
    commands = [(node, [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                        "--master-addr", cluster.hostname(0), "--master-port", "29402", *TRAIN, *args])
                for node in range(2)]
    log = run_on_nodes(cluster, commands, tmp_path)
    assert "local rank 0 of 2 on node 0 of 2" in rank0_line(log)
    assert "layout dp 2 x tp 2" in rank0_line(log)
    assert_equals_one_node(save_dir, one_node["tp"])


def test_fairseq_launch_with_two_processes_per_host_finds_two_nodes_of_two(cluster, one_node, data_dir, tmp_path):
    # fairseq's flags say each rank's number, nothing of its host: the hosts must tell
    # that ranks 0-1 share node0 and 2-3 node1, or the hook would reduce over 4 nodes x 1.
    save_dir = tmp_path / "run"
    args = args_for(data_dir, save_dir, UPDATES, BATCH, HIERARCHICAL)
    init = f"tcp://{cluster.hostname(0)}:29403"
    commands = [(rank // 2, [sys.executable, *TRAIN, *args, "--distributed-world-size", "4",
                             "--distributed-rank", str(rank), "--distributed-init-method", init])
                for rank in range(4)]
    log = run_on_nodes(cluster, commands, tmp_path)
    line = rank0_line(log)
    assert "launcher explicit: rank 0 of 4, local rank 0 of 2 on node 0 of 2" in line
    assert "one process per host" not in line
    assert ("2 nodes found from the hosts (node0: ranks 0-1; node1: ranks 2-3); launcher explicit does not say "
            "which ranks share a node") in log
    assert "(hierarchical allreduce over 2 nodes x 2 ranks)" in log
    assert_equals_one_node(save_dir, one_node["hierarchical"])


@pytest.mark.skipif(shutil.which("mpiexec") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="mpiexec or mpi4py missing (apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py)")
def test_mpiexec_with_a_hostfile_across_nodes_equals_one_node(cluster, one_node, data_dir, tmp_path):
    # OpenMPI starts node1's daemon through the rsh agent, which enters node1's namespace
    # where ssh would log in; MPI's shared-memory communicator then sees two hosts.
    save_dir = tmp_path / "run"
    # --bind-to none: each node's daemon would pin its ranks to cores 0 and 1, which both nodes
    # share here, and the ranks could not move off a core that other work keeps busy. Ranks
    # waiting in MPI (for a peer still importing torch) yield the core instead of spinning.
    mpiexec = ["mpiexec", "--allow-run-as-root", "--bind-to", "none", "--hostfile", str(cluster.hostfile(2)),
               "--mca", "plm_rsh_agent", str(cluster.rsh_agent()), "--mca", "mpi_yield_when_idle", "1",
               "-n", "4", "-x", "OMP_NUM_THREADS"]
    if "PYTHONPATH" in os.environ:
        mpiexec += ["-x", "PYTHONPATH"]
    # OpenMPI gives ranks a terminal: JSON lines keep tqdm's bars out of the output.
    args = args_for(data_dir, save_dir, UPDATES, BATCH, HIERARCHICAL + ["--log-format", "json"])
    log = run_on_nodes(cluster, [(0, [*mpiexec, sys.executable, *TRAIN, *args])], tmp_path)
    assert "launcher mpi: rank 0 of 4, local rank 0 of 2 on node 0 of 2" in rank0_line(log)
    assert "2 nodes from launcher mpi, on 2 hosts (node0: ranks 0-1; node1: ranks 2-3)" in log
    assert "(hierarchical allreduce over 2 nodes x 2 ranks)" in log
    assert_equals_one_node(save_dir, one_node["hierarchical"])


def test_a_launcher_node_that_spans_hosts_is_refused_in_one_line(cluster, data_dir, tmp_path):
    # torchrun's variables exported by hand, both ranks claiming node 0 (GROUP_RANK=0,
    # LOCAL_WORLD_SIZE=2) while each runs on a node of its own: a hierarchical hook would
    # send its "intra-node" leg over the network. Refused once the hosts are known.
    exported = {"TORCHELASTIC_RUN_ID": "by-hand", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": cluster.hostname(0), "MASTER_PORT": "29404"}
    args = args_for(data_dir, tmp_path / "run", UPDATES, BATCH, HIERARCHICAL)
    procs = [cluster.popen(rank, [sys.executable, *TRAIN, *args], cwd=tmp_path,
                           env={**environment(), **exported, "RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in range(2)]
    outputs = [proc.communicate(timeout=RUN_TIMEOUT) for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], outputs
    errors = [line for line in outputs[0][1].splitlines() if line.startswith("distlm: error:")]
    assert errors == [
        "distlm: error: launcher torchelastic puts ranks 0-1 on node 0, but they run on 2 hosts (node0: rank 0; "
        "node1: rank 1); the ranks of a node must share a host: start one launcher per host (torchrun --node-rank, "
        "srun --ntasks-per-node) or correct the node variables exported by hand"], outputs[0][1][-4000:]
    assert "Traceback" not in outputs[0][1]
    assert not (tmp_path / "run" / "checkpoint_last").exists()  # refused before the first update
