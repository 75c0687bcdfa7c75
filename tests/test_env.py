"""Launcher detection: every launcher from a patched environment, the fixed order, explicit flags."""

from __future__ import annotations

import sys
import types

import pytest

from distlm.env import (
    ClusterEnv,
    ExplicitLaunch,
    expand_slurm_nodelist,
    expand_slurm_tasks_per_node,
    parse_init_method,
    resolve_master_via_mpi,
    slurm_master_port,
)
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
    env = ClusterEnv.detect(torchrun_env(rank=6))
    assert env == ClusterEnv(
        rank=6, world_size=8, local_rank=2, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="10.0.0.1", master_port=29500, launcher="torchelastic",
    )
    assert env.is_distributed


def test_torchrun_without_run_id_needs_the_full_set():
    base = torchrun_env(rank=1)
    del base["TORCHELASTIC_RUN_ID"]
    assert ClusterEnv.detect(base).launcher == "torchelastic"
    partial = {k: v for k, v in base.items() if k != "LOCAL_RANK"}
    assert ClusterEnv.detect(partial).launcher == "single"


def test_torchrun_node_rank_falls_back_to_rank_over_local_size():
    base = torchrun_env(rank=5)
    del base["GROUP_RANK"], base["GROUP_WORLD_SIZE"]
    env = ClusterEnv.detect(base)
    assert (env.node_rank, env.num_nodes) == (5 // 4, 8 // 4)


def test_torchrun_missing_master_port_is_a_usage_error():
    base = torchrun_env()
    del base["MASTER_PORT"]
    with pytest.raises(UsageError, match="MASTER_PORT"):
        ClusterEnv.detect(base)


# --------------------------------------------------------------------------- Slurm


def test_srun_task_detected():
    env = ClusterEnv.detect(srun_env(procid=5))
    assert env == ClusterEnv(
        rank=5, world_size=6, local_rank=1, local_world_size=2, node_rank=2, num_nodes=3,
        master_addr="gpu-st-p4d-24xlarge-7", master_port=slurm_master_port(123456), launcher="slurm",
    )


def test_slurm_port_comes_from_the_job_id_and_separates_concurrent_jobs():
    port_a = ClusterEnv.detect(srun_env(SLURM_JOB_ID="4000")).master_port
    port_b = ClusterEnv.detect(srun_env(SLURM_JOB_ID="4001")).master_port
    assert port_a != port_b
    assert all(10000 <= p < 30000 for p in (port_a, port_b))
    assert slurm_master_port(123456) == 10000 + 123456 % 20000


def test_slurm_master_addr_and_port_from_environment_win():
    env = ClusterEnv.detect(srun_env(MASTER_ADDR="head", MASTER_PORT="31337"))
    assert (env.master_addr, env.master_port) == ("head", 31337)


def test_slurm_uneven_tasks_per_node():
    # srun -n 5 on 3 nodes: 2,2,1 tasks; task 4 is alone on the last node.
    environ = srun_env(
        procid=4, SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5", SLURM_LOCALID="0", SLURM_NODEID="2",
        SLURM_STEP_TASKS_PER_NODE="2(x2),1",
    )
    env = ClusterEnv.detect(environ)
    assert (env.local_world_size, env.node_rank, env.num_nodes) == (1, 2, 3)


def test_slurm_master_is_first_host_of_job_nodelist_when_no_step_list():
    environ = srun_env(SLURM_JOB_NODELIST="node[01-04,07]")
    del environ["SLURM_STEP_NODELIST"]
    assert ClusterEnv.detect(environ).master_addr == "node01"


def test_sbatch_shell_without_srun_is_not_slurm():
    # The batch script's own shell: SLURM_PROCID=0 and SLURM_NTASKS=6, but no step.
    environ = srun_env(procid=0)
    del environ["SLURM_STEP_ID"]
    assert ClusterEnv.detect(environ).launcher == "single"


def test_interactive_one_task_shell_is_not_slurm():
    environ = srun_env(
        procid=0, SLURM_JOB_NAME="bash", SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1",
        SLURM_STEP_TASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_STEP_NUM_NODES="1",
    )
    assert ClusterEnv.detect(environ).launcher == "single"


def test_mpirun_inside_an_allocation_is_mpi_not_slurm():
    # mpirun started its daemons with srun (one task per node); the MPI ranks inherit
    # that step's SLURM_PROCID, which is the node index, not the rank.
    environ = srun_env(procid=1, SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                       SLURM_LOCALID="0", SLURM_NODEID="1", SLURM_NNODES="2", SLURM_STEP_NUM_NODES="2")
    environ.update(ompi_env(rank=5))
    env = ClusterEnv.detect(environ)
    assert (env.launcher, env.rank, env.world_size) == ("mpi", 5, 8)


def test_malformed_slurm_values_name_the_variable():
    with pytest.raises(UsageError, match="SLURM_PROCID"):
        ClusterEnv.detect(srun_env(SLURM_PROCID="five"))
    with pytest.raises(UsageError, match="SLURM_PROCID=6 must be below SLURM_STEP_NUM_TASKS=6"):
        ClusterEnv.detect(srun_env(procid=6))
    with pytest.raises(UsageError, match="SLURM_STEP_NODELIST"):
        ClusterEnv.detect(srun_env(SLURM_STEP_NODELIST="node[1-"))
    with pytest.raises(UsageError, match="SLURM_STEP_TASKS_PER_NODE"):
        ClusterEnv.detect(srun_env(SLURM_STEP_TASKS_PER_NODE="2(y3)"))


# --------------------------------------------------------------------------- order


def test_torchrun_under_srun_is_torchelastic():
    environ = {**srun_env(procid=1), **torchrun_env(rank=6)}
    env = ClusterEnv.detect(environ)
    assert (env.launcher, env.rank, env.world_size) == ("torchelastic", 6, 8)


def test_slurm_comes_before_mpi_when_they_agree():
    # srun --mpi=pmi2 exports PMI_RANK/PMI_SIZE equal to Slurm's.
    environ = {**srun_env(procid=3), "PMI_RANK": "3", "PMI_SIZE": "6", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert ClusterEnv.detect(environ).launcher == "slurm"


def test_nothing_is_single_process():
    env = ClusterEnv.detect({})
    assert (env.rank, env.world_size, env.launcher, env.master_addr, env.master_port) == (0, 1, "single", "127.0.0.1", None)
    assert not env.is_distributed


def test_detect_defaults_to_os_environ(monkeypatch):
    for name, value in torchrun_env(rank=2).items():
        monkeypatch.setenv(name, value)
    assert ClusterEnv.detect().rank == 2


# --------------------------------------------------------------------------- MPI


def test_openmpi_by_slot_mapping_and_no_master():
    env = ClusterEnv.detect(ompi_env(rank=5))
    assert env == ClusterEnv(
        rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr=None, master_port=None, launcher="mpi",
    )


def test_openmpi_master_from_environment():
    env = ClusterEnv.detect(ompi_env(MASTER_ADDR="node0", MASTER_PORT="29400"))
    assert (env.master_addr, env.master_port) == ("node0", 29400)
    with pytest.raises(UsageError, match="MASTER_PORT"):
        ClusterEnv.detect(ompi_env(MASTER_ADDR="node0"))


def test_mpich_and_intel_mpi():
    environ = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    env = ClusterEnv.detect(environ)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("mpi", 2, 4, 0, 2)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    with pytest.raises(UsageError, match="MPI_LOCALRANKID"):
        ClusterEnv.detect({"PMI_RANK": "2", "PMI_SIZE": "4"})


def test_malformed_mpi_values_name_the_variable():
    with pytest.raises(UsageError, match="OMPI_COMM_WORLD_LOCAL_RANK=4 must be below OMPI_COMM_WORLD_LOCAL_SIZE=4"):
        ClusterEnv.detect(ompi_env(OMPI_COMM_WORLD_LOCAL_RANK="4"))
    with pytest.raises(UsageError, match="OMPI_COMM_WORLD_SIZE"):
        ClusterEnv.detect(ompi_env(OMPI_COMM_WORLD_SIZE="0"))


def fake_mpi4py(monkeypatch, broadcast_result=None):
    """A stand-in mpi4py whose COMM_WORLD.bcast records what it was given."""
    calls = []

    class Comm:
        def bcast(self, obj, root=0):
            calls.append((obj, root))
            return obj if broadcast_result is None else broadcast_result

    module = types.ModuleType("mpi4py")
    module.MPI = types.SimpleNamespace(COMM_WORLD=Comm())
    monkeypatch.setitem(sys.modules, "mpi4py", module)
    return calls


def test_resolve_master_via_mpi_rank0_proposes_and_broadcasts(monkeypatch):
    calls = fake_mpi4py(monkeypatch)
    env = resolve_master_via_mpi(ClusterEnv.detect(ompi_env(rank=0)))
    (proposal, root), = calls
    assert root == 0 and proposal == (env.master_addr, env.master_port)
    assert env.master_addr and 0 < env.master_port < 65536


def test_resolve_master_via_mpi_other_ranks_take_rank0s_answer(monkeypatch):
    calls = fake_mpi4py(monkeypatch, broadcast_result=("node0", 41000))
    env = resolve_master_via_mpi(ClusterEnv.detect(ompi_env(rank=5)))
    assert calls == [(None, 0)]
    assert (env.master_addr, env.master_port, env.rank) == ("node0", 41000, 5)


def test_resolve_master_via_mpi_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(UsageError, match=r"pip install 'distlm\[mpi\]'"):
        resolve_master_via_mpi(ClusterEnv.detect(ompi_env()))


def test_resolve_master_via_mpi_keeps_a_known_master(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # would fail if it were imported
    env = ClusterEnv.detect(torchrun_env())
    assert resolve_master_via_mpi(env) is env


# --------------------------------------------------------------------------- explicit flags


def test_explicit_launch_alone():
    env = ClusterEnv.detect({}, ExplicitLaunch(world_size=4, rank=3, init_method="tcp://10.1.2.3:23456"))
    assert env == ClusterEnv(
        rank=3, world_size=4, local_rank=0, local_world_size=1, node_rank=3, num_nodes=4,
        master_addr="10.1.2.3", master_port=23456, launcher="explicit",
    )


def test_explicit_env_init_method_reads_master_variables():
    env = ClusterEnv.detect(
        {"MASTER_ADDR": "h0", "MASTER_PORT": "1234"}, ExplicitLaunch(world_size=2, rank=1, init_method="env://")
    )
    assert (env.master_addr, env.master_port, env.launcher) == ("h0", 1234, "explicit")
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        ClusterEnv.detect({}, ExplicitLaunch(world_size=2, rank=1, init_method="env://"))


def test_explicit_world_size_one_alone_is_single():
    assert ClusterEnv.detect({}, ExplicitLaunch(world_size=1)).launcher == "single"


def test_explicit_incomplete_names_missing_flags():
    with pytest.raises(UsageError, match="--distributed-rank, --distributed-init-method"):
        ClusterEnv.detect({}, ExplicitLaunch(world_size=4))


def test_explicit_rank_out_of_range():
    with pytest.raises(UsageError, match="--distributed-rank 4 must be below --distributed-world-size 4"):
        ClusterEnv.detect({}, ExplicitLaunch(world_size=4, rank=4, init_method="tcp://h:1"))


def test_explicit_conflicting_with_slurm_names_both():
    with pytest.raises(UsageError, match="--distributed-rank 3 but SLURM_PROCID=1"):
        ClusterEnv.detect(srun_env(procid=1), ExplicitLaunch(rank=3))
    with pytest.raises(UsageError, match="--distributed-world-size 4 but SLURM_STEP_NUM_TASKS=6"):
        ClusterEnv.detect(srun_env(procid=1), ExplicitLaunch(world_size=4))


def test_explicit_agreeing_with_launcher_supplies_the_master():
    env = ClusterEnv.detect(
        srun_env(procid=1), ExplicitLaunch(world_size=6, rank=1, init_method="tcp://[fd00::1]:4000")
    )
    assert (env.launcher, env.rank, env.master_addr, env.master_port) == ("slurm", 1, "fd00::1", 4000)


@pytest.mark.parametrize(
    "bad", ["tcp://host", "tcp://:29500", "http://host:29500", "file:///tmp/x", "tcp://host:99999", "host:29500", "tcp://h:abc"]
)
def test_malformed_init_method_names_the_flag(bad):
    with pytest.raises(UsageError, match="--distributed-init-method"):
        ClusterEnv.detect({}, ExplicitLaunch(world_size=2, rank=0, init_method=bad))


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
