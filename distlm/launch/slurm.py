"""Tasks started by Slurm's ``srun``: their variables, hostlists and the master port a job step agrees on."""

from __future__ import annotations

import itertools
import re
from typing import Mapping

from distlm.errors import UsageError
from distlm.launch.cluster_env import ClusterEnv, check_below, first_present, master_from_environ, read_int

# Slurm runs these job names for interactive allocations (salloc's default shell,
# `srun --pty bash`); a Python started by hand in such a shell is not an srun task.
_SLURM_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


# Derived Slurm ports live in [10000, 30000): below Linux's ephemeral range
# (32768-60999) so they never clash with ports the kernel hands to outgoing connections.
_SLURM_PORT_BASE = 10000


_SLURM_PORT_SPAN = 20000


# Each step id moves the port by 20000 / golden ratio (coprime with 20000): consecutive
# steps land far apart, so steps of one job never share a port and steps of jobs whose
# ids are close (concurrent jobs on one node) rarely do.
_SLURM_STEP_STRIDE = 12361


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm hostlist, in order: ``"node[01-03,07],gpu5"`` -> node01 node02 node03 node07 gpu5.

    Supports comma lists, bracket ranges with zero padding (the padding is the width of
    the range's first bound, as Slurm writes it), several bracket groups in one name
    (``c[1-2]-d[3-4]`` is their cartesian product) and several names in one list.
    Raises ``ValueError`` on malformed input.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("empty nodelist")
    hosts: list[str] = []
    for expression in _split_top_level(text):
        hosts.extend(_expand_host_expression(expression))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unclosed '[' in {text!r}")
    parts.append(text[start:])
    if any(not part.strip() for part in parts):
        raise ValueError(f"empty host name in {text!r}")
    return [part.strip() for part in parts]


def _expand_host_expression(expression: str) -> list[str]:
    # "c[1-2]-d[3-4]" -> [["c"], ["1", "2"], ["-d"], ["3", "4"]] -> cartesian product.
    pieces: list[list[str]] = []
    position = 0
    for match in re.finditer(r"\[([^\[\]]*)\]", expression):
        if match.start() > position:
            pieces.append([expression[position : match.start()]])
        pieces.append(_expand_bracket(match.group(1), expression))
        position = match.end()
    if position < len(expression):
        pieces.append([expression[position:]])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def _expand_bracket(body: str, expression: str) -> list[str]:
    values: list[str] = []
    for item in body.split(","):
        item = item.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ValueError(f"bad range {item!r} in {expression!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {item!r} runs backwards in {expression!r}")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return values


def expand_slurm_tasks_per_node(value: str) -> list[int]:
    """Tasks on each node: ``"2(x3),1"`` -> [2, 2, 2, 1]; ``"8"`` -> [8]. Raises ``ValueError``."""
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(f"bad tasks-per-node entry {item!r} in {value!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_master_port(job_id: int, step_id: int = 0) -> int:
    """A port every task of a job step agrees on without talking: a function of job and step id.

    A fixed default port (29500) collides as soon as two jobs share a node; the job id
    differs between concurrent jobs, so their ports differ too (unless their ids differ
    by a multiple of 20000, which concurrent jobs practically never do). The step id
    separates the steps of one job (``srun ... doctor`` then ``srun ... train``, or steps
    run side by side): a step's rank 0 may still hold the previous step's port, or share
    the node with a concurrent step. Step 0 keeps the job id's own port. The result lies
    in [10000, 30000).
    """
    return _SLURM_PORT_BASE + (job_id + step_id * _SLURM_STEP_STRIDE) % _SLURM_PORT_SPAN


class SlurmLauncher:
    """Tasks started by ``srun`` (not the batch script's shell, not an interactive shell)."""

    RANK_VAR = "SLURM_PROCID"
    # srun exports the step's own task count; SLURM_NTASKS may describe the allocation.
    WORLD_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    NUM_NODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")  # the second is the older spelling

    @staticmethod
    def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
        # An sbatch script's shell also has SLURM_PROCID=0 and SLURM_NTASKS=N, but no
        # step id: only srun starts a step. Treating that shell as rank 0 of N would
        # make a `python train.py` in the script wait forever for N-1 peers.
        if "SLURM_PROCID" not in environ:
            return None
        if first_present(environ, SlurmLauncher.STEP_VARS) is None:
            return None
        world_var = first_present(environ, SlurmLauncher.WORLD_VARS)
        if world_var is None:
            return None
        world_size = read_int(environ, world_var, minimum=1)
        rank = read_int(environ, "SLURM_PROCID")
        check_below(rank, "SLURM_PROCID", world_size, world_var)
        # `srun --pty bash` is a one-task step; a script run by hand in it is a single
        # process, not Slurm rank 0 of 1 (same numbers, but the master would be derived).
        if environ.get("SLURM_JOB_NAME") in _SLURM_INTERACTIVE_JOB_NAMES and world_size == 1:
            return None
        # mpirun/mpiexec inside an allocation start their per-node daemons with srun,
        # so MPI ranks inherit the daemon step's SLURM_PROCID (one task per node). When
        # the MPI variables tell a different story, they are the ones describing us.
        if _mpi_disagrees(environ, rank, world_size):
            return None

        local_rank = read_int(environ, "SLURM_LOCALID")
        node_rank = read_int(environ, "SLURM_NODEID")
        num_nodes_var = first_present(environ, SlurmLauncher.NUM_NODES_VARS)
        if num_nodes_var is None:
            raise UsageError("SLURM_NNODES is not set; srun sets it, check the job's environment")
        num_nodes = read_int(environ, num_nodes_var, minimum=1)
        check_below(node_rank, "SLURM_NODEID", num_nodes, num_nodes_var)
        local_world_size = _slurm_local_world_size(environ, node_rank)
        check_below(local_rank, "SLURM_LOCALID", local_world_size, "tasks on this node")

        master_addr, master_port = master_from_environ(environ)
        if master_addr is None:
            master_addr = _slurm_first_host(environ)
        if master_port is None:
            if "SLURM_JOB_ID" not in environ:
                raise UsageError("neither MASTER_PORT nor SLURM_JOB_ID is set; export MASTER_PORT in the job script")
            step_var = first_present(environ, SlurmLauncher.STEP_VARS)
            assert step_var is not None  # detect() returned None above without one
            master_port = slurm_master_port(read_int(environ, "SLURM_JOB_ID"), read_int(environ, step_var))
        return ClusterEnv(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=master_addr,
            master_port=master_port,
            launcher="slurm",
        )


def _mpi_disagrees(environ: Mapping[str, str], rank: int, world_size: int) -> bool:
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in environ and size_var in environ:
            if (read_int(environ, rank_var), read_int(environ, size_var, minimum=1)) != (rank, world_size):
                return True
    return False


def _slurm_local_world_size(environ: Mapping[str, str], node_rank: int) -> int:
    name = first_present(environ, SlurmLauncher.TASKS_PER_NODE_VARS)
    if name is None:
        raise UsageError("SLURM_TASKS_PER_NODE is not set; srun sets it, check the job's environment")
    try:
        counts = expand_slurm_tasks_per_node(environ[name])
    except ValueError as err:
        raise UsageError(f"{name}={environ[name]!r} is malformed ({err}); fix or unset it") from None
    if len(counts) == 1:  # one number applies to every node (e.g. SLURM_NTASKS_PER_NODE=8)
        return counts[0]
    if node_rank >= len(counts):
        raise UsageError(f"{name}={environ[name]!r} lists {len(counts)} nodes but SLURM_NODEID={node_rank}")
    return counts[node_rank]


def _slurm_first_host(environ: Mapping[str, str]) -> str:
    # The step's list first: a step may run on a subset of the job's nodes, and task 0
    # runs on the first node of the step.
    name = first_present(environ, SlurmLauncher.NODELIST_VARS)
    if name is None:
        raise UsageError("SLURM_JOB_NODELIST is not set; export MASTER_ADDR in the job script")
    try:
        return expand_slurm_nodelist(environ[name])[0]
    except ValueError as err:
        raise UsageError(f"{name}={environ[name]!r} is not a Slurm nodelist ({err}); export MASTER_ADDR instead") from None
