"""Launcher detection: every launcher from a patched environment, the fixed order, explicit flags,
contradictory environments, Slurm step ports, device selection and MPI node layouts (pure logic;
the real mpiexec placement test is tests/test_mpi_placement.py)."""

from __future__ import annotations

import os
import socket
import sys
import types

import pytest

from distlm.launch import mpi as env_module
from distlm.launch.cluster_env import ClusterEnv, ExplicitLaunch
from distlm.launch.detect import detect_launch
from distlm.launch.devices import device_index
from distlm.launch.slurm import expand_slurm_nodelist, expand_slurm_tasks_per_node, slurm_master_port
from distlm.launch.hosts import Host, node_layout, place_by_hosts, ranks_by_node, this_host
from distlm.launch.explicit import parse_init_method
from distlm.launch.mpi import resolve_master_via_mpi
from distlm.errors import UsageError


def torchrun_env(rank: int = 3, **extra: str) -> dict[str, str]:
    """What torchrun exports to worker ``rank`` of 2 nodes x 4 processes."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": "8",
        "LOCAL_RANK": str(rank % 4),
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": str(rank // 4),
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job-1",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    env.update(extra)
    return env


def srun_env(procid: int = 5, **extra: str) -> dict[str, str]:
    """What srun exports to task ``procid`` of `srun -N 3 -n 6` (2 tasks per node)."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "train",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": "6",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_LOCALID": str(procid % 2),
        "SLURM_NODEID": str(procid // 2),
        "SLURM_NNODES": "3",
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
        "SLURM_TASKS_PER_NODE": "2(x3)",
        "SLURM_JOB_NODELIST": "gpu-st-p4d-24xlarge-[7-9]",
        "SLURM_STEP_NODELIST": "gpu-st-p4d-24xlarge-[7-9]",
    }
    env.update(extra)
    return env


def ompi_env(rank: int = 5, **extra: str) -> dict[str, str]:
    """OpenMPI's mpiexec -n 8 with 4 slots per node."""
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 4),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        # Counted across all jobs on the node, not the node index: must be ignored.
        "OMPI_COMM_WORLD_NODE_RANK": "0",
    }
    env.update(extra)
    return env


# --------------------------------------------------------------------------- torchrun


def test_torchrun_detected_with_all_fields():
    env = detect_launch(torchrun_env(rank=6))
    assert env == ClusterEnv(
        rank=6, world_size=8, local_rank=2, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="10.0.0.1", master_port=29500, launcher="torchelastic",
    )
    assert env.is_distributed


def test_torchrun_without_run_id_needs_the_full_set():
    base = torchrun_env(rank=1)
    del base["TORCHELASTIC_RUN_ID"]
    assert detect_launch(base).launcher == "torchelastic"
    # Without LOCAL_RANK it is not torchrun's set, and not one process per host either
    # (LOCAL_WORLD_SIZE=4 says four share a host): named, not a silent single process.
    partial = {k: v for k, v in base.items() if k != "LOCAL_RANK"}
    with pytest.raises(UsageError, match="LOCAL_WORLD_SIZE=4 is set but LOCAL_RANK is not"):
        detect_launch(partial)
    no_master = {k: v for k, v in base.items() if k != "MASTER_ADDR"}
    with pytest.raises(UsageError, match="RANK, WORLD_SIZE and LOCAL_RANK are set but MASTER_ADDR is not"):
        detect_launch(no_master)


def test_torchrun_node_rank_falls_back_to_rank_over_local_size():
    base = torchrun_env(rank=5)
    del base["GROUP_RANK"], base["GROUP_WORLD_SIZE"]
    env = detect_launch(base)
    assert (env.node_rank, env.num_nodes) == (5 // 4, 8 // 4)


def test_torchrun_missing_master_port_is_a_usage_error():
    base = torchrun_env()
    del base["MASTER_PORT"]
    with pytest.raises(UsageError, match="MASTER_PORT"):
        detect_launch(base)


# --------------------------------------------------------------------------- Slurm


def test_srun_task_detected():
    env = detect_launch(srun_env(procid=5))
    assert env == ClusterEnv(
        rank=5, world_size=6, local_rank=1, local_world_size=2, node_rank=2, num_nodes=3,
        master_addr="gpu-st-p4d-24xlarge-7", master_port=slurm_master_port(123456, 0), launcher="slurm",
    )


def test_slurm_port_comes_from_the_job_id_and_separates_concurrent_jobs():
    port_a = detect_launch(srun_env(SLURM_JOB_ID="4000")).master_port
    port_b = detect_launch(srun_env(SLURM_JOB_ID="4001")).master_port
    assert port_a != port_b
    assert all(10000 <= p < 30000 for p in (port_a, port_b))
    assert slurm_master_port(123456) == 10000 + 123456 % 20000


def test_slurm_steps_of_one_job_get_different_ports():
    # `srun ... doctor` (step 0) then `srun ... train` (step 1), or two steps side by side:
    # the job id alone gave both the same port.
    doctor = {detect_launch(srun_env(procid=p, SLURM_STEP_ID="0")).master_port for p in range(6)}
    train = {detect_launch(srun_env(procid=p, SLURM_STEP_ID="1")).master_port for p in range(6)}
    assert len(doctor) == 1 and len(train) == 1  # every task of a step agrees without talking
    assert doctor != train
    assert all(10000 <= port < 30000 for port in doctor | train)
    # Slurm's older spelling of the step id gives the same port.
    older = srun_env(procid=2)
    older["SLURM_STEPID"] = older.pop("SLURM_STEP_ID")
    assert detect_launch(older).master_port == detect_launch(srun_env(procid=2)).master_port


def test_slurm_ports_of_nearby_jobs_and_steps_do_not_meet():
    # Concurrent jobs on a node have close ids; their first steps must not share a port
    # (job 4001 step 0 against job 4000 step 1, ...).
    ports = [slurm_master_port(job, step) for job in range(4000, 4100) for step in range(10)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= port < 30000 for port in ports)
    # Every step of one job gets its own port, as far as the range allows.
    assert len({slurm_master_port(123456, step) for step in range(20000)}) == 20000


def test_slurm_master_addr_and_port_from_environment_win():
    env = detect_launch(srun_env(MASTER_ADDR="head", MASTER_PORT="31337"))
    assert (env.master_addr, env.master_port) == ("head", 31337)


def test_slurm_uneven_tasks_per_node():
    # srun -n 5 on 3 nodes: 2,2,1 tasks; task 4 is alone on the last node.
    environ = srun_env(
        procid=4, SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5", SLURM_LOCALID="0", SLURM_NODEID="2",
        SLURM_STEP_TASKS_PER_NODE="2(x2),1",
    )
    env = detect_launch(environ)
    assert (env.local_world_size, env.node_rank, env.num_nodes) == (1, 2, 3)


def test_slurm_master_is_first_host_of_job_nodelist_when_no_step_list():
    environ = srun_env(SLURM_JOB_NODELIST="node[01-04,07]")
    del environ["SLURM_STEP_NODELIST"]
    assert detect_launch(environ).master_addr == "node01"


def test_sbatch_shell_without_srun_is_not_slurm():
    # The batch script's own shell: SLURM_PROCID=0 and SLURM_NTASKS=6, but no step.
    environ = srun_env(procid=0)
    del environ["SLURM_STEP_ID"]
    assert detect_launch(environ).launcher == "single"


def test_interactive_one_task_shell_is_not_slurm():
    environ = srun_env(
        procid=0, SLURM_JOB_NAME="bash", SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1",
        SLURM_STEP_TASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_STEP_NUM_NODES="1",
    )
    assert detect_launch(environ).launcher == "single"


def test_mpirun_inside_an_allocation_is_mpi_not_slurm():
    # mpirun started its daemons with srun (one task per node); the MPI ranks inherit
    # that step's SLURM_PROCID, which is the node index, not the rank.
    environ = srun_env(procid=1, SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                       SLURM_LOCALID="0", SLURM_NODEID="1", SLURM_NNODES="2", SLURM_STEP_NUM_NODES="2")
    environ.update(ompi_env(rank=5))
    env = detect_launch(environ)
    assert (env.launcher, env.rank, env.world_size) == ("mpi", 5, 8)


def test_malformed_slurm_values_name_the_variable():
    with pytest.raises(UsageError, match="SLURM_PROCID"):
        detect_launch(srun_env(SLURM_PROCID="five"))
    with pytest.raises(UsageError, match="SLURM_PROCID=6 must be below SLURM_STEP_NUM_TASKS=6"):
        detect_launch(srun_env(procid=6))
    with pytest.raises(UsageError, match="SLURM_STEP_NODELIST"):
        detect_launch(srun_env(SLURM_STEP_NODELIST="node[1-"))
    with pytest.raises(UsageError, match="SLURM_STEP_TASKS_PER_NODE"):
        detect_launch(srun_env(SLURM_STEP_TASKS_PER_NODE="2(y3)"))


# --------------------------------------------------------------------------- order


def test_torchrun_under_srun_is_torchelastic():
    # `srun torchrun`: Slurm's task is the torchrun agent (task 1 of 6), torchrun's RANK the
    # worker (6 of 8). Two processes, two worlds: not a contradiction.
    environ = {**srun_env(procid=1), **torchrun_env(rank=6)}
    env = detect_launch(environ)
    assert (env.launcher, env.rank, env.world_size) == ("torchelastic", 6, 8)


def test_slurm_comes_before_mpi_when_they_agree():
    # srun --mpi=pmi2 exports PMI_RANK/PMI_SIZE equal to Slurm's.
    environ = {**srun_env(procid=3), "PMI_RANK": "3", "PMI_SIZE": "6", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert detect_launch(environ).launcher == "slurm"


def test_nothing_is_single_process():
    env = detect_launch({})
    assert (env.rank, env.world_size, env.launcher, env.master_addr, env.master_port) == (0, 1, "single", "127.0.0.1", None)
    assert not env.is_distributed


def test_detect_defaults_to_os_environ(monkeypatch):
    for name, value in torchrun_env(rank=2).items():
        monkeypatch.setenv(name, value)
    assert detect_launch().rank == 2


# --------------------------------------------------------------------------- MPI


def test_openmpi_by_slot_mapping_and_no_master():
    env = detect_launch(ompi_env(rank=5))
    assert env == ClusterEnv(
        rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr=None, master_port=None, launcher="mpi",
    )


def test_openmpi_master_from_environment():
    env = detect_launch(ompi_env(MASTER_ADDR="node0", MASTER_PORT="29400"))
    assert (env.master_addr, env.master_port) == ("node0", 29400)
    with pytest.raises(UsageError, match="MASTER_PORT"):
        detect_launch(ompi_env(MASTER_ADDR="node0"))


def test_mpich_and_intel_mpi():
    environ = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    env = detect_launch(environ)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("mpi", 2, 4, 0, 2)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    with pytest.raises(UsageError, match="MPI_LOCALRANKID"):
        detect_launch({"PMI_RANK": "2", "PMI_SIZE": "4"})


def test_malformed_mpi_values_name_the_variable():
    with pytest.raises(UsageError, match="OMPI_COMM_WORLD_LOCAL_RANK=4 must be below OMPI_COMM_WORLD_LOCAL_SIZE=4"):
        detect_launch(ompi_env(OMPI_COMM_WORLD_LOCAL_RANK="4"))
    with pytest.raises(UsageError, match="OMPI_COMM_WORLD_SIZE"):
        detect_launch(ompi_env(OMPI_COMM_WORLD_SIZE="0"))


def fake_mpi4py(monkeypatch, rank, size=8, broadcast_result=None, hosts=None):
    """A stand-in mpi4py for rank ``rank`` of ``size`` whose COMM_WORLD.bcast records what it was given.

    The node layout is stubbed: ``mpi_node_layout`` answers from ``hosts`` (the host of
    each rank; default 4 consecutive ranks per host) and records the communicators it got.
    The real one runs under mpiexec in tests/test_mpi_placement.py.
    """
    calls = []
    hosts = hosts if hosts is not None else [f"host{r // 4}" for r in range(size)]

    class Comm:
        def Get_rank(self):
            return rank

        def Get_size(self):
            return size

        def bcast(self, obj, root=0):
            calls.append((obj, root))
            return obj if broadcast_result is None else broadcast_result

    def stub_layout(comm, node_comm=None):
        calls.append(("layout", node_comm))
        return node_layout(comm.Get_rank(), hosts)

    module = types.ModuleType("mpi4py")
    module.MPI = types.SimpleNamespace(COMM_WORLD=Comm())
    monkeypatch.setitem(sys.modules, "mpi4py", module)
    monkeypatch.setattr(env_module, "mpi_node_layout", stub_layout)
    return calls


def test_resolve_master_via_mpi_rank0_proposes_and_broadcasts(monkeypatch):
    calls = fake_mpi4py(monkeypatch, rank=0)
    env = resolve_master_via_mpi(detect_launch(ompi_env(rank=0)))
    (proposal, root), layout_call = calls
    assert root == 0 and proposal == (env.master_addr, env.master_port)
    assert env.master_addr and 0 < env.master_port < 65536
    assert layout_call == ("layout", None)  # the real split, nothing injected


def test_resolve_master_via_mpi_other_ranks_take_rank0s_answer(monkeypatch):
    calls = fake_mpi4py(monkeypatch, rank=5, broadcast_result=("node0", 41000))
    env = resolve_master_via_mpi(detect_launch(ompi_env(rank=5)))
    assert calls == [(None, 0), ("layout", None)]
    assert (env.master_addr, env.master_port, env.rank) == ("node0", 41000, 5)


def test_resolve_master_via_mpi_takes_the_nodes_from_mpi_not_from_rank_order(monkeypatch):
    # mpiexec --map-by node on 2 hosts of 4 slots: ranks alternate between the hosts, while
    # the environment alone can only guess rank // local size (node 1 for rank 5, local rank 1).
    hosts = ["a", "b"] * 4
    fake_mpi4py(monkeypatch, rank=5, hosts=hosts)
    detected = detect_launch(ompi_env(rank=5, MASTER_ADDR="a", MASTER_PORT="29400"))
    env = resolve_master_via_mpi(detected)
    same_host = [r for r in range(8) if hosts[r] == hosts[5]]
    assert env.node_of_rank == tuple(0 if h == hosts[0] else 1 for h in hosts)
    assert (env.node_rank, env.num_nodes) == (env.node_of_rank[5], len(set(hosts)))
    assert (env.local_rank, env.local_world_size) == (same_host.index(5), len(same_host))
    assert (env.master_addr, env.master_port, env.rank, env.world_size) == ("a", 29400, 5, 8)
    assert resolve_master_via_mpi(env) is env  # known master and nodes: nothing left to ask


def test_resolve_master_via_mpi_refuses_an_mpi4py_that_sees_another_world(monkeypatch):
    # mpi4py built against another MPI than the mpiexec: every process is its own world.
    fake_mpi4py(monkeypatch, rank=0, size=1)
    with pytest.raises(UsageError, match="mpi4py sees rank 0 of 1 but the launcher set rank 5 of 8"):
        resolve_master_via_mpi(detect_launch(ompi_env(rank=5)))


def test_resolve_master_via_mpi_with_exported_master_and_no_mpi4py_runs_as_before(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    env = detect_launch(ompi_env(rank=5, MASTER_ADDR="node0", MASTER_PORT="29400"))
    assert resolve_master_via_mpi(env) is env and env.node_of_rank is None


def test_resolve_master_via_mpi_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(UsageError, match=r"pip install 'distlm\[mpi\]'"):
        resolve_master_via_mpi(detect_launch(ompi_env()))


def test_resolve_master_via_mpi_keeps_a_known_master(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # would fail if it were imported
    env = detect_launch(torchrun_env())
    assert resolve_master_via_mpi(env) is env


# --------------------------------------------------------------------------- node layouts


def reference_layout(rank: int, hosts: list[str]) -> tuple:
    """The layout the spec describes, computed from scratch: nodes ordered by their lowest rank."""
    first_rank = {host: min(r for r, h in enumerate(hosts) if h == host) for host in hosts}
    order = sorted(set(hosts), key=first_rank.__getitem__)
    node_of_rank = tuple(order.index(h) for h in hosts)
    mates = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return order.index(hosts[rank]), len(order), mates.index(rank), len(mates), node_of_rank


@pytest.mark.parametrize(
    "hosts",
    [
        ["a", "b", "a", "b"],  # mpiexec --map-by node: round-robin
        ["a", "a", "b", "b"],  # by slot
        ["z", "y", "y", "z", "x", "x"],  # names sorting against rank order
        ["a", "b", "b", "b", "c"],  # uneven
    ],
)
def test_node_layout_numbers_nodes_by_their_lowest_rank(hosts):
    layouts = [node_layout(rank, hosts) for rank in range(len(hosts))]
    for rank, layout in enumerate(layouts):
        assert tuple(layout) == reference_layout(rank, hosts)
    assert len({layout.node_of_rank for layout in layouts}) == 1  # every rank agrees
    # A ClusterEnv accepts what node_layout gives.
    for rank, layout in enumerate(layouts):
        ClusterEnv(
            rank=rank, world_size=len(hosts), local_rank=layout.local_rank, local_world_size=layout.local_world_size,
            node_rank=layout.node_rank, num_nodes=layout.num_nodes, master_addr=None, master_port=None,
            launcher="mpi", node_of_rank=layout.node_of_rank,
        )


def test_ranks_by_node_is_the_membership_grid():
    hosts = ["a", "b", "a", "b", "c", "c"]
    nodes = ranks_by_node(node_layout(0, hosts).node_of_rank)
    assert nodes == [[r for r, h in enumerate(hosts) if h == host] for host in ("a", "b", "c")]


def test_cluster_env_refuses_a_membership_that_contradicts_it():
    fields = dict(rank=1, world_size=4, local_rank=0, local_world_size=2, node_rank=1, num_nodes=2,
                  master_addr=None, master_port=None, launcher="mpi")
    ClusterEnv(**fields, node_of_rank=(0, 1, 0, 1))
    for wrong in [(0, 0, 1, 1), (0, 1, 0), (0, 1, 2, 1), (0, 1, 1, 1)]:
        with pytest.raises(ValueError, match="node_of_rank"):
            ClusterEnv(**fields, node_of_rank=wrong)


# --------------------------------------------------------------------------- nodes from the hosts

BOOT_A, BOOT_B = "boot-a", "boot-b"


def fairseq_envs(world_size: int) -> list[ClusterEnv]:
    """Every rank of a fairseq-style launch: --distributed-rank R --distributed-world-size N."""
    return [detect_launch({}, ExplicitLaunch(world_size=world_size, rank=rank, init_method="tcp://h0:29500"))
            for rank in range(world_size)]


def placed(envs: list[ClusterEnv], hosts: list[Host]) -> list[tuple[ClusterEnv, str]]:
    """``place_by_hosts`` on every rank, with what the all-gather at start gives each."""
    return [place_by_hosts(env, hosts, [e.node_rank for e in envs]) for env in envs]


def test_fairseq_launch_with_two_processes_per_host_finds_two_nodes_of_two():
    # The launch assumes one process per host (node R of N); the hosts say otherwise.
    envs = fairseq_envs(4)
    assert [(e.node_rank, e.num_nodes, e.nodes_assumed is not None) for e in envs] == [(r, 4, True) for r in range(4)]
    hosts = [Host("node0", BOOT_A, 1)] * 2 + [Host("node1", BOOT_B, 1)] * 2
    results = placed(envs, hosts)
    assert [(e.node_rank, e.local_rank, e.local_world_size, e.num_nodes) for e, _ in results] == [
        (0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]
    assert {e.node_of_rank for e, _ in results} == {(0, 0, 1, 1)}
    assert all(e.nodes_assumed is None for e, _ in results)
    assert results[2][0].describe().startswith("launcher explicit: rank 2 of 4, local rank 0 of 2 on node 1 of 2")
    assert results[0][1] == ("2 nodes found from the hosts (node0: ranks 0-1; node1: ranks 2-3); "
                             "launcher explicit does not say which ranks share a node")


@pytest.mark.parametrize("hosts, node_of_rank", [
    # One name on two machines (every container calls itself localhost): the boot id tells them apart.
    ([Host("localhost", BOOT_A, 1), Host("localhost", BOOT_B, 1)] * 2, (0, 1, 0, 1)),
    # One machine, two network namespaces (pods, simulated nodes): two hosts.
    ([Host("h", BOOT_A, 1), Host("h", BOOT_A, 1), Host("h", BOOT_A, 2), Host("h", BOOT_A, 2)], (0, 0, 1, 1)),
    # One process per host after all: the launch's own assumption, now known.
    ([Host(f"h{r}", BOOT_A, r) for r in range(4)], (0, 1, 2, 3)),
])
def test_a_host_is_its_name_boot_and_network_namespace(hosts, node_of_rank):
    for env, _ in placed(fairseq_envs(4), hosts):
        assert env.node_of_rank == node_of_rank


def test_env_launch_and_torchrun_without_group_rank_take_the_nodes_from_the_hosts():
    kubeflow = [detect_launch(kubeflow_env(rank)) for rank in range(4)]
    partial = {k: v for k, v in torchrun_env().items() if k not in ("GROUP_RANK", "GROUP_WORLD_SIZE")}
    torchrun = [detect_launch({**partial, "RANK": str(r), "LOCAL_RANK": str(r % 4)}) for r in range(8)]
    kubeflow_placed = placed(kubeflow, [Host(f"pod{r}", BOOT_A, r) for r in range(4)])
    assert [e.node_of_rank for e, _ in kubeflow_placed] == [(0, 1, 2, 3)] * 4
    # torchrun assumed consecutive ranks per node; here the hosts hold them round robin.
    hosts = [Host("a", BOOT_A, 1), Host("b", BOOT_B, 1)] * 4
    assert [e.node_of_rank for e, _ in placed(torchrun, hosts)] == [(0, 1) * 4] * 8


def test_a_launcher_node_spanning_hosts_is_one_line_on_every_rank():
    envs = [detect_launch(torchrun_env(rank, GROUP_RANK="0")) for rank in range(8)]  # GROUP_RANK exported wrong
    hosts = [Host("node0", BOOT_A, 1)] * 4 + [Host("node1", BOOT_B, 1)] * 4
    for env in envs:
        with pytest.raises(UsageError) as refused:
            place_by_hosts(env, hosts, [e.node_rank for e in envs])
        assert str(refused.value) == (
            "launcher torchelastic puts ranks 0-7 on node 0, but they run on 2 hosts (node0: ranks 0-3; "
            "node1: ranks 4-7); the ranks of a node must share a host: start one launcher per host (torchrun "
            "--node-rank, srun --ntasks-per-node) or correct the node variables exported by hand")


def test_a_launcher_that_says_the_nodes_keeps_them():
    # Right: torchrun's 2 nodes on 2 hosts. Finer than the hosts: two agents on one machine
    # (how tests and stand-ins simulate nodes) keep their 2 nodes.
    envs = [detect_launch(torchrun_env(rank)) for rank in range(8)]
    two_hosts = [Host("node0", BOOT_A, 1)] * 4 + [Host("node1", BOOT_B, 1)] * 4
    for hosts, line in [(two_hosts, "2 nodes from launcher torchelastic, on 2 hosts (node0: ranks 0-3; node1: ranks 4-7)"),
                        ([Host("vm", BOOT_A, 1)] * 8, "2 nodes from launcher torchelastic, on 1 host (vm: ranks 0-7)")]:
        for env, (result, said) in zip(envs, placed(envs, hosts)):
            assert result is env and said == line


def test_this_host_names_this_process_host():
    host = this_host()
    assert host.name == socket.gethostname()
    assert host.netns == os.stat("/proc/self/ns/net").st_ino
    assert host.boot_id == open("/proc/sys/kernel/random/boot_id").read().strip()


# --------------------------------------------------------------------------- devices


def test_one_visible_device_is_every_ranks_own():
    # srun --gpus-per-task=1: local rank 3 of 4 sees one GPU, as index 0.
    assert [device_index(rank, 4, 1) for rank in range(4)] == [0, 0, 0, 0]


def test_ranks_share_the_visible_devices_by_local_rank():
    assert [device_index(rank, 8, 8) for rank in range(8)] == list(range(8))
    assert [device_index(rank, 2, 4) for rank in range(2)] == [0, 1]


def test_more_local_ranks_than_visible_devices_names_the_variable():
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    for rank in (0, 15):  # every rank of the node alike, not only the ones past the end
        with pytest.raises(UsageError, match=r"16 ranks on this node but 8 devices visible \(CUDA_VISIBLE_DEVICES=0,1,"):
            device_index(rank, 16, 8, environ=environ)
    with pytest.raises(UsageError, match="NEURON_RT_VISIBLE_CORES=unset"):
        device_index(0, 1, 0, "NEURON_RT_VISIBLE_CORES", environ={})


# --------------------------------------------------------------------------- RANK/WORLD_SIZE alone


def kubeflow_env(rank: int = 3, **extra: str) -> dict[str, str]:
    """What a Kubeflow PyTorchJob of 4 pods exports to pod ``rank`` (one process each)."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "bert-master-0",
        "MASTER_PORT": "23456",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


def test_kubeflow_pytorchjob_is_one_process_per_host():
    envs = [detect_launch(kubeflow_env(rank=r)) for r in range(4)]
    for rank, env in enumerate(envs):
        assert env == ClusterEnv(
            rank=rank, world_size=4, local_rank=0, local_world_size=1, node_rank=rank, num_nodes=4,
            master_addr="bert-master-0", master_port=23456, launcher="env",
        )
    assert "launcher env, one process per host: rank 3 of 4" in envs[3].describe()


def test_rank_variables_alone_do_not_steal_other_launchers():
    # A job script exporting RANK/WORLD_SIZE per task, agreeing with srun or mpiexec.
    assert detect_launch(srun_env(procid=5, RANK="5", WORLD_SIZE="6")).launcher == "slurm"
    assert detect_launch(srun_env(procid=5, WORLD_SIZE="6")).launcher == "slurm"
    assert detect_launch(ompi_env(rank=5, RANK="5", WORLD_SIZE="8")).launcher == "mpi"


def test_rank_variables_with_one_process_and_no_master():
    env = detect_launch({"RANK": "0", "WORLD_SIZE": "1"})
    assert (env.launcher, env.is_distributed, env.master_addr, env.master_port) == ("env", False, "127.0.0.1", None)


def test_rank_variables_with_explicit_flags():
    # fairseq flags may repeat the environment and name the master, never contradict it.
    environ = {"RANK": "2", "WORLD_SIZE": "4"}
    env = detect_launch(environ, ExplicitLaunch(world_size=4, rank=2, init_method="tcp://h0:29500"))
    assert (env.launcher, env.rank, env.master_addr, env.master_port) == ("env", 2, "h0", 29500)
    with pytest.raises(UsageError, match="--distributed-rank 3 but RANK=2"):
        detect_launch(kubeflow_env(rank=2), ExplicitLaunch(rank=3))
    env = detect_launch(kubeflow_env(rank=2), ExplicitLaunch(init_method="env://"))
    assert (env.master_addr, env.master_port) == ("bert-master-0", 23456)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "4"}, "WORLD_SIZE is set but RANK is not"),
        (kubeflow_env(rank=4), "RANK=4 must be below WORLD_SIZE=4"),
        (kubeflow_env(MASTER_PORT="x"), "MASTER_PORT='x' is not an integer"),
        ({k: v for k, v in kubeflow_env().items() if k != "MASTER_PORT"}, "MASTER_ADDR is set but MASTER_PORT is not"),
        ({k: v for k, v in kubeflow_env().items() if k != "MASTER_ADDR"}, "MASTER_PORT is set but MASTER_ADDR is not"),
        ({"RANK": "1", "WORLD_SIZE": "4"}, "RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT are not"),
        (kubeflow_env(LOCAL_WORLD_SIZE="2"), "LOCAL_WORLD_SIZE=2 is set but LOCAL_RANK is not"),
        # Set by hand next to srun's task variables, without torchrun: two stories of one process.
        (srun_env(procid=5, RANK="5", WORLD_SIZE="8"),
         r"WORLD_SIZE=8 but SLURM_STEP_NUM_TASKS=6 and no torchrun \(TORCHELASTIC_RUN_ID unset\)"),
        (srun_env(procid=5, RANK="0", WORLD_SIZE="6"), "RANK=0 but SLURM_PROCID=5 and no torchrun"),
        (srun_env(procid=5, RANK="3"), "RANK=3 but SLURM_PROCID=5"),
        ({**srun_env(procid=1), **{k: v for k, v in torchrun_env(rank=6).items() if k != "TORCHELASTIC_RUN_ID"}},
         "WORLD_SIZE=8 but SLURM_STEP_NUM_TASKS=6"),
        (ompi_env(rank=5, RANK="5", WORLD_SIZE="4"), "WORLD_SIZE=4 but OMPI_COMM_WORLD_SIZE=8"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "RANK": "0"},
         "RANK=0 but PMI_RANK=1"),
    ],
)
def test_partial_or_contradictory_environment_is_one_line_naming_the_variables(environ, message):
    with pytest.raises(UsageError, match=message) as caught:
        detect_launch(environ)
    assert "\n" not in str(caught.value)


# --------------------------------------------------------------------------- explicit flags


def test_explicit_launch_alone():
    env = detect_launch({}, ExplicitLaunch(world_size=4, rank=3, init_method="tcp://10.1.2.3:23456"))
    assert env == ClusterEnv(
        rank=3, world_size=4, local_rank=0, local_world_size=1, node_rank=3, num_nodes=4,
        master_addr="10.1.2.3", master_port=23456, launcher="explicit",
    )


def test_explicit_env_init_method_reads_master_variables():
    env = detect_launch(
        {"MASTER_ADDR": "h0", "MASTER_PORT": "1234"}, ExplicitLaunch(world_size=2, rank=1, init_method="env://")
    )
    assert (env.master_addr, env.master_port, env.launcher) == ("h0", 1234, "explicit")
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        detect_launch({}, ExplicitLaunch(world_size=2, rank=1, init_method="env://"))


def test_explicit_world_size_one_alone_is_single():
    assert detect_launch({}, ExplicitLaunch(world_size=1)).launcher == "single"


def test_explicit_incomplete_names_missing_flags():
    with pytest.raises(UsageError, match="--distributed-rank, --distributed-init-method"):
        detect_launch({}, ExplicitLaunch(world_size=4))


def test_explicit_rank_out_of_range():
    with pytest.raises(UsageError, match="--distributed-rank 4 must be below --distributed-world-size 4"):
        detect_launch({}, ExplicitLaunch(world_size=4, rank=4, init_method="tcp://h:1"))


def test_explicit_conflicting_with_slurm_names_both():
    with pytest.raises(UsageError, match="--distributed-rank 3 but SLURM_PROCID=1"):
        detect_launch(srun_env(procid=1), ExplicitLaunch(rank=3))
    with pytest.raises(UsageError, match="--distributed-world-size 4 but SLURM_STEP_NUM_TASKS=6"):
        detect_launch(srun_env(procid=1), ExplicitLaunch(world_size=4))


def test_explicit_agreeing_with_launcher_supplies_the_master():
    env = detect_launch(
        srun_env(procid=1), ExplicitLaunch(world_size=6, rank=1, init_method="tcp://[fd00::1]:4000")
    )
    assert (env.launcher, env.rank, env.master_addr, env.master_port) == ("slurm", 1, "fd00::1", 4000)


@pytest.mark.parametrize(
    "bad", ["tcp://host", "tcp://:29500", "http://host:29500", "file:///tmp/x", "tcp://host:99999", "host:29500", "tcp://h:abc"]
)
def test_malformed_init_method_names_the_flag(bad):
    with pytest.raises(UsageError, match="--distributed-init-method"):
        detect_launch({}, ExplicitLaunch(world_size=2, rank=0, init_method=bad))


def test_parse_init_method():
    assert parse_init_method("tcp://node-1.example:29500") == ("node-1.example", 29500)
    assert parse_init_method("env://") is None


# --------------------------------------------------------------------------- list parsing


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node7", ["node7"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu-st-p4d-24xlarge-[1-3]", ["gpu-st-p4d-24xlarge-1", "gpu-st-p4d-24xlarge-2", "gpu-st-p4d-24xlarge-3"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("c[1-2]-d[3-4]", ["c1-d3", "c1-d4", "c2-d3", "c2-d4"]),
        ("x[1,3],y[05-06],z", ["x1", "x3", "y05", "y06", "z"]),
        ("rack[1-2]node", ["rack1node", "rack2node"]),
    ],
)
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "n[1-", "n]1[", "n[]", "n[3-1]", "a,,b", "n[a-b]", "n[[1]]"])
def test_expand_slurm_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_slurm_nodelist(bad)


@pytest.mark.parametrize(
    "value, counts", [("8", [8]), ("2(x3)", [2, 2, 2]), ("2(x2),1", [2, 2, 1]), ("4,3(x2)", [4, 3, 3])]
)
def test_expand_slurm_tasks_per_node(value, counts):
    assert expand_slurm_tasks_per_node(value) == counts
