"""Who am I in the job? Rank, world size, local rank and master address from the launcher.

``ClusterEnv.detect()`` asks each launcher in a fixed order -- TorchElastic (torchrun),
Slurm (srun), MPI (OpenMPI, then MPICH/Intel MPI), then plain ``RANK``/``WORLD_SIZE``
exports (``env://``, a Kubeflow PyTorchJob: one process per host) -- and the first that
recognises its variables describes this process. fairseq-style flags
(``--distributed-rank`` and friends) come next: they fill in a launch nobody else
describes, or must agree with the launcher that does. Nothing at all means one process.

``RANK`` and ``WORLD_SIZE`` are read by several launchers, so they are checked first
(``check_rank_variables``): set by hand next to srun's or mpiexec's own variables they
must agree with them, and alone they must come together.

Each launcher is a small class with a static ``detect(environ)`` that returns a
``ClusterEnv`` or ``None``, so adding a launcher never touches another one's rules
(Lightning Fabric's ``plugins/environments``; fairseq's ``infer_init_method`` mixes all
launchers in one function, which is what this layout avoids).
"""

from __future__ import annotations

import itertools
import os
import re
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Hashable, Mapping, NamedTuple, Sequence
from urllib.parse import urlsplit

from distlm.agreement import describe_ranks
from distlm.errors import UsageError

LAUNCHER_NAMES = ("torchelastic", "slurm", "mpi", "env", "explicit", "single")

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


@dataclass(frozen=True)
class ExplicitLaunch:
    """fairseq-style flags for a process the user starts once per rank."""

    world_size: int | None = None
    rank: int | None = None
    init_method: str | None = None
    """``tcp://HOST:PORT`` of rank 0, or ``env://`` to read MASTER_ADDR/MASTER_PORT."""

    @property
    def is_empty(self) -> bool:
        return self.world_size is None and self.rank is None and self.init_method is None


@dataclass(frozen=True)
class ClusterEnv:
    """This process's place in the job; the same on every launcher."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    launcher: str
    node_of_rank: tuple[int, ...] | None = None
    """The node index of every rank, where this process knows it without a process group:
    under mpiexec once ``resolve_master_via_mpi`` has asked MPI which ranks share a host.
    None elsewhere; then each rank knows only its own ``node_rank``."""
    nodes_assumed: str | None = field(default=None, compare=False)
    """Set when the launcher did not say which node each rank runs on, so ``node_rank`` is
    only assumed (consecutive ranks per node, or one process per host): why. None when known.
    ``place_by_hosts`` replaces an assumed place with the hosts' own once the process group
    exists. Not compared: it says how the place was found, not where the process is."""

    def __post_init__(self) -> None:
        # Launchers validate with the user's variable names first; this only guards
        # against a ClusterEnv built by hand (tests, tools) being inconsistent.
        if self.launcher not in LAUNCHER_NAMES:
            raise ValueError(f"unknown launcher {self.launcher!r}; expected one of {LAUNCHER_NAMES}")
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not (0 <= self.local_rank < self.local_world_size):
            raise ValueError(f"local rank {self.local_rank} is outside local world size {self.local_world_size}")
        if not (0 <= self.node_rank < self.num_nodes):
            raise ValueError(f"node rank {self.node_rank} is outside {self.num_nodes} nodes")
        if self.node_of_rank is not None:
            nodes = self.node_of_rank
            if (
                len(nodes) != self.world_size
                or nodes[self.rank] != self.node_rank
                or set(nodes) != set(range(self.num_nodes))
                or nodes.count(self.node_rank) != self.local_world_size
            ):
                raise ValueError(
                    f"node_of_rank {nodes} does not fit rank {self.rank} of {self.world_size} on node "
                    f"{self.node_rank} of {self.num_nodes} with {self.local_world_size} local ranks"
                )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        """One line for the log: the launcher and this process's place, e.g. for rank 0 to print."""
        assumed = self.launcher in ("env", "explicit") and self.is_distributed and self.node_of_rank is None
        hosts = ", one process per host" if assumed else ""
        master = f"{self.master_addr}:{self.master_port}" if self.master_port is not None else str(self.master_addr)
        return (
            f"launcher {self.launcher}{hosts}: rank {self.rank} of {self.world_size}, "
            f"local rank {self.local_rank} of {self.local_world_size} on node {self.node_rank} of {self.num_nodes}, "
            f"master {master}"
        )

    @staticmethod
    def detect(
        environ: Mapping[str, str] | None = None,
        explicit: ExplicitLaunch | None = None,
    ) -> "ClusterEnv":
        """The first launcher that recognises ``environ`` (default ``os.environ``), merged with ``explicit``."""
        environ = os.environ if environ is None else environ
        explicit = explicit if explicit is not None else ExplicitLaunch()
        check_rank_variables(environ)
        for launcher in LAUNCHERS:
            env = launcher.detect(environ)
            if env is not None:
                env = _merge_explicit(env, launcher, explicit, environ)
                return _require_env_master(env) if launcher is EnvLauncher else env
        return _explicit_or_single(explicit, environ)


# --------------------------------------------------------------------------- parsing


def _read_int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = environ.get(name)
    if raw is None:
        raise UsageError(f"{name} is not set; the launcher that set the other variables should set it too")
    try:
        value = int(raw.strip())
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer; fix or unset it") from None
    if value < minimum:
        raise UsageError(f"{name}={value} must be at least {minimum}; fix or unset it")
    return value


def _read_optional_int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    return _read_int(environ, name, minimum) if name in environ else None


def _read_port(environ: Mapping[str, str], name: str) -> int:
    port = _read_int(environ, name, minimum=1)
    if port > 65535:
        raise UsageError(f"{name}={port} is not a TCP port (1-65535); fix or unset it")
    return port


def _first_present(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in environ), None)


def _check_below(value: int, value_name: str, bound: int, bound_name: str) -> None:
    if value >= bound:
        raise UsageError(f"{value_name}={value} must be below {bound_name}={bound}; the launch is inconsistent")


def _check_at_most(value: int, value_name: str, bound: int, bound_name: str) -> None:
    if value > bound:
        raise UsageError(f"{value_name}={value} exceeds {bound_name}={bound}; the launch is inconsistent")


def _master_from_environ(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = environ.get("MASTER_ADDR") or None
    port = _read_port(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None
    return addr, port


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- Slurm lists


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


# --------------------------------------------------------------------------- launchers


class TorchElasticLauncher:
    """torchrun / torch.distributed.run, or anything exporting the same variables."""

    RANK_VAR = "RANK"
    WORLD_VARS = ("WORLD_SIZE",)

    @staticmethod
    def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
        full_set = all(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
        if "TORCHELASTIC_RUN_ID" not in environ and not full_set:
            return None
        world_size = _read_int(environ, "WORLD_SIZE", minimum=1)
        rank = _read_int(environ, "RANK")
        _check_below(rank, "RANK", world_size, "WORLD_SIZE")
        local_world_size = _read_int(environ, "LOCAL_WORLD_SIZE", minimum=1)
        _check_at_most(local_world_size, "LOCAL_WORLD_SIZE", world_size, "WORLD_SIZE")
        local_rank = _read_int(environ, "LOCAL_RANK")
        _check_below(local_rank, "LOCAL_RANK", local_world_size, "LOCAL_WORLD_SIZE")
        # torchrun exports the agent (= node) index and count; plain exports may not.
        num_nodes = _read_optional_int(environ, "GROUP_WORLD_SIZE", minimum=1)
        num_nodes = num_nodes if num_nodes is not None else _ceil_div(world_size, local_world_size)
        node_rank = _read_optional_int(environ, "GROUP_RANK")
        nodes_assumed = None
        if node_rank is None:
            node_rank = rank // local_world_size
            if local_world_size < world_size:
                nodes_assumed = "GROUP_RANK is not set; export each node's index as GROUP_RANK, as torchrun does"
        _check_below(node_rank, "node rank (GROUP_RANK, or RANK // LOCAL_WORLD_SIZE)", num_nodes, "node count")
        if not environ.get("MASTER_ADDR"):
            raise UsageError("MASTER_ADDR is not set; torchrun sets it, a manual launch must export it")
        if "MASTER_PORT" not in environ:
            raise UsageError("MASTER_PORT is not set; torchrun sets it, a manual launch must export it")
        return ClusterEnv(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=environ["MASTER_ADDR"],
            master_port=_read_port(environ, "MASTER_PORT"),
            launcher="torchelastic",
            nodes_assumed=nodes_assumed,
        )


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
        if _first_present(environ, SlurmLauncher.STEP_VARS) is None:
            return None
        world_var = _first_present(environ, SlurmLauncher.WORLD_VARS)
        if world_var is None:
            return None
        world_size = _read_int(environ, world_var, minimum=1)
        rank = _read_int(environ, "SLURM_PROCID")
        _check_below(rank, "SLURM_PROCID", world_size, world_var)
        # `srun --pty bash` is a one-task step; a script run by hand in it is a single
        # process, not Slurm rank 0 of 1 (same numbers, but the master would be derived).
        if environ.get("SLURM_JOB_NAME") in _SLURM_INTERACTIVE_JOB_NAMES and world_size == 1:
            return None
        # mpirun/mpiexec inside an allocation start their per-node daemons with srun,
        # so MPI ranks inherit the daemon step's SLURM_PROCID (one task per node). When
        # the MPI variables tell a different story, they are the ones describing us.
        if _mpi_disagrees(environ, rank, world_size):
            return None

        local_rank = _read_int(environ, "SLURM_LOCALID")
        node_rank = _read_int(environ, "SLURM_NODEID")
        num_nodes_var = _first_present(environ, SlurmLauncher.NUM_NODES_VARS)
        if num_nodes_var is None:
            raise UsageError("SLURM_NNODES is not set; srun sets it, check the job's environment")
        num_nodes = _read_int(environ, num_nodes_var, minimum=1)
        _check_below(node_rank, "SLURM_NODEID", num_nodes, num_nodes_var)
        local_world_size = _slurm_local_world_size(environ, node_rank)
        _check_below(local_rank, "SLURM_LOCALID", local_world_size, "tasks on this node")

        master_addr, master_port = _master_from_environ(environ)
        if master_addr is None:
            master_addr = _slurm_first_host(environ)
        if master_port is None:
            if "SLURM_JOB_ID" not in environ:
                raise UsageError("neither MASTER_PORT nor SLURM_JOB_ID is set; export MASTER_PORT in the job script")
            step_var = _first_present(environ, SlurmLauncher.STEP_VARS)
            assert step_var is not None  # detect() returned None above without one
            master_port = slurm_master_port(_read_int(environ, "SLURM_JOB_ID"), _read_int(environ, step_var))
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
            if (_read_int(environ, rank_var), _read_int(environ, size_var, minimum=1)) != (rank, world_size):
                return True
    return False


def _slurm_local_world_size(environ: Mapping[str, str], node_rank: int) -> int:
    name = _first_present(environ, SlurmLauncher.TASKS_PER_NODE_VARS)
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
    name = _first_present(environ, SlurmLauncher.NODELIST_VARS)
    if name is None:
        raise UsageError("SLURM_JOB_NODELIST is not set; export MASTER_ADDR in the job script")
    try:
        return expand_slurm_nodelist(environ[name])[0]
    except ValueError as err:
        raise UsageError(f"{name}={environ[name]!r} is not a Slurm nodelist ({err}); export MASTER_ADDR instead") from None


class _MPILauncher:
    """An MPI process manager, known by the variables it exports to every rank."""

    RANK_VAR: str
    WORLD_VARS: tuple[str]
    LOCAL_VARS: tuple[str, str]  # local rank, local size

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> ClusterEnv | None:
        if cls.RANK_VAR not in environ or cls.WORLD_VARS[0] not in environ:
            return None
        return _mpi_env(environ, (cls.RANK_VAR, cls.WORLD_VARS[0]), cls.LOCAL_VARS)


class OpenMPILauncher(_MPILauncher):
    """``mpiexec``/``mpirun`` from OpenMPI.

    OMPI_COMM_WORLD_NODE_RANK is not the node index: OpenMPI documents it as this
    process's relative rank on its node counted across all jobs. Not used.
    """

    RANK_VAR = "OMPI_COMM_WORLD_RANK"
    WORLD_VARS = ("OMPI_COMM_WORLD_SIZE",)
    LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")


class MPICHLauncher(_MPILauncher):
    """``mpiexec`` from MPICH or Intel MPI (the Hydra process manager)."""

    RANK_VAR = "PMI_RANK"
    WORLD_VARS = ("PMI_SIZE",)
    LOCAL_VARS = ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")


def _mpi_env(environ: Mapping[str, str], world: tuple[str, str], local: tuple[str, str]) -> ClusterEnv:
    rank_var, size_var = world
    local_rank_var, local_size_var = local
    world_size = _read_int(environ, size_var, minimum=1)
    rank = _read_int(environ, rank_var)
    _check_below(rank, rank_var, world_size, size_var)
    for name in local:
        if name not in environ:
            raise UsageError(
                f"{rank_var} is set but {name} is not; launch with the MPI's own mpiexec (which sets it) or with torchrun"
            )
    local_world_size = _read_int(environ, local_size_var, minimum=1)
    _check_at_most(local_world_size, local_size_var, world_size, size_var)
    local_rank = _read_int(environ, local_rank_var)
    _check_below(local_rank, local_rank_var, local_world_size, local_size_var)
    # MPI exports no node index. rank // ranks-per-node is right for mpiexec's default
    # by-slot mapping only (--map-by node places ranks round-robin); it stands in until
    # resolve_master_via_mpi() asks MPI which ranks share a host (mpi_node_layout), and is
    # marked as assumed unless every rank is local.
    # mpiexec sets no master either: None until resolve_master_via_mpi() agrees on one.
    master_addr, master_port = _master_from_environ(environ)
    if (master_addr is None) != (master_port is None):
        raise UsageError(
            "under mpiexec export both MASTER_ADDR and MASTER_PORT, or neither (then mpi4py agrees on them)"
        )
    return ClusterEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size,
        num_nodes=_ceil_div(world_size, local_world_size),
        master_addr=master_addr,
        master_port=master_port,
        launcher="mpi",
        nodes_assumed=None if local_world_size == world_size else (
            f"{size_var} and {local_size_var} say how many ranks, not which share a host; install mpi4py "
            "(pip install 'distlm[mpi]') so that distlm asks MPI"
        ),
    )


_ONE_PER_HOST = "each process is assumed to run on a host of its own (nothing exports a local rank)"


class EnvLauncher:
    """``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` and nothing else: one process per host.

    What a Kubeflow PyTorchJob exports to each pod, and what a plain ``env://`` launch
    reads. Without ``LOCAL_RANK`` nobody started several processes on a host, so each
    rank is its own node: local rank 0 of 1, node ``RANK`` of ``WORLD_SIZE``. Checked
    after torchrun, srun and mpiexec, which set ``RANK`` and ``WORLD_SIZE`` too (torchrun
    its own, srun and mpiexec when a job script exports them per task).
    """

    RANK_VAR = "RANK"
    WORLD_VARS = ("WORLD_SIZE",)

    @staticmethod
    def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
        if "RANK" not in environ and "WORLD_SIZE" not in environ:
            return None
        # Pairing (RANK with WORLD_SIZE) was checked by check_rank_variables().
        world_size = _read_int(environ, "WORLD_SIZE", minimum=1)
        rank = _read_int(environ, "RANK")
        _check_below(rank, "RANK", world_size, "WORLD_SIZE")
        if "LOCAL_RANK" in environ:  # torchrun's set, which TorchElasticLauncher takes when MASTER_ADDR is there
            raise UsageError(
                "RANK, WORLD_SIZE and LOCAL_RANK are set but MASTER_ADDR is not; "
                "export MASTER_ADDR and MASTER_PORT (rank 0's address and a free port), or launch with torchrun"
            )
        local_world_size = _read_optional_int(environ, "LOCAL_WORLD_SIZE", minimum=1)
        if local_world_size not in (None, 1):
            raise UsageError(
                f"LOCAL_WORLD_SIZE={local_world_size} is set but LOCAL_RANK is not; export LOCAL_RANK for "
                "each process (torchrun does), or unset LOCAL_WORLD_SIZE for one process per host"
            )
        master_addr, master_port = _master_from_environ(environ)
        if master_addr is not None and master_port is None:
            raise UsageError("MASTER_ADDR is set but MASTER_PORT is not; export both (rank 0's address, a free port)")
        if master_addr is None and master_port is not None:
            raise UsageError("MASTER_PORT is set but MASTER_ADDR is not; export both (rank 0's address, a free port)")
        return ClusterEnv(
            rank=rank,
            world_size=world_size,
            local_rank=0,
            local_world_size=1,
            node_rank=rank,
            num_nodes=world_size,
            master_addr=master_addr,
            master_port=master_port,
            launcher="env",
            nodes_assumed=_ONE_PER_HOST if world_size > 1 else None,
        )


def _require_env_master(env: ClusterEnv) -> ClusterEnv:
    """The env launcher after explicit flags: the master must be known by now (flags may name it)."""
    if env.master_addr is not None:
        return env
    if env.is_distributed:
        raise UsageError(
            "RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT are not; export both "
            "(rank 0's address and a free port), or pass --distributed-init-method tcp://HOST:PORT"
        )
    return replace(env, master_addr="127.0.0.1")  # one process: as single_process_env()


# Fixed order: torchrun's variables are the most specific (srun torchrun ... sets both
# torchrun's and Slurm's), then Slurm, then MPI (whose daemons may carry Slurm's), then
# bare RANK/WORLD_SIZE, which srun and mpiexec tasks may also carry.
LAUNCHERS = (TorchElasticLauncher, SlurmLauncher, OpenMPILauncher, MPICHLauncher, EnvLauncher)
_TASK_LAUNCHERS = (SlurmLauncher, OpenMPILauncher, MPICHLauncher)


def check_rank_variables(environ: Mapping[str, str]) -> None:
    """``RANK``/``WORLD_SIZE`` must be whole and must not contradict srun or mpiexec.

    The rule, by who set them:

    * torchrun (``TORCHELASTIC_RUN_ID`` set): they describe the worker. Under
      ``srun torchrun`` Slurm's ``SLURM_PROCID``/``SLURM_NTASKS`` describe the torchrun
      agent task that started it, a different process in a smaller world, so the two
      are not compared (TorchElasticLauncher checks torchrun's own set).
    * anyone else (a job script, ``srun bash -c 'RANK=$SLURM_PROCID ...'``): if srun or
      mpiexec describe this process too, both describe the same process, so each of
      ``RANK`` and ``WORLD_SIZE`` that is set must equal the task's rank and world size
      (``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS``, ``OMPI_COMM_WORLD_RANK``/``_SIZE``,
      ``PMI_RANK``/``PMI_SIZE``); either alone is fine there, the task launcher gives the
      other. A per-node launcher other than torchrun started by srun (one task starting
      several workers) is refused for that reason: start the workers with torchrun.
    * no launcher: ``RANK`` and ``WORLD_SIZE`` must come together (EnvLauncher).

    Raises a one-line ``UsageError`` naming the variables that disagree.
    """
    if "TORCHELASTIC_RUN_ID" in environ:
        return
    has_rank, has_world = "RANK" in environ, "WORLD_SIZE" in environ
    if not (has_rank or has_world):
        return
    for launcher in _TASK_LAUNCHERS:
        task = launcher.detect(environ)
        if task is None:
            continue
        world_var = _first_present(environ, launcher.WORLD_VARS) or launcher.WORLD_VARS[0]
        fix = (
            f"unset RANK and WORLD_SIZE ({task.launcher} gives every task its rank), "
            "or start the workers with torchrun"
        )
        if has_world and _read_int(environ, "WORLD_SIZE", minimum=1) != task.world_size:
            raise UsageError(
                f"WORLD_SIZE={environ['WORLD_SIZE']} but {world_var}={task.world_size} and no torchrun "
                f"(TORCHELASTIC_RUN_ID unset); {fix}"
            )
        if has_rank and _read_int(environ, "RANK") != task.rank:
            raise UsageError(
                f"RANK={environ['RANK']} but {launcher.RANK_VAR}={task.rank} and no torchrun "
                f"(TORCHELASTIC_RUN_ID unset); {fix}"
            )
        return
    if has_rank != has_world:
        present, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        raise UsageError(
            f"{present} is set but {missing} is not; export both (with MASTER_ADDR and MASTER_PORT), "
            f"or unset {present} for a single process"
        )


# --------------------------------------------------------------------------- devices


def device_index(
    local_rank: int,
    local_world_size: int,
    visible_devices: int,
    visible_variable: str = "CUDA_VISIBLE_DEVICES",
    environ: Mapping[str, str] | None = None,
    parent_environ: Mapping[str, str] | None = None,
) -> int:
    """The index, among the devices this process sees, of the device local rank ``local_rank`` uses.

    ``local_rank % visible_devices``. With several visible, the node's ranks share them, so
    more local ranks than visible devices would put two ranks on one device: a
    ``UsageError`` naming ``visible_variable`` (on every rank of the node alike, so no rank
    starts and waits for the others).

    One visible device is this rank's own whatever its local rank where each rank was given
    its own: ``srun --gpus-per-task=1``, or a per-rank ``visible_variable`` set by a
    wrapper, show each one GPU as index 0. torchrun gives its workers no device of their
    own: a worker that sees one device with ``visible_variable`` as torchrun's agent had it
    (inherited, not set for this worker) shares it with every other worker of the node,
    which is refused. ``environ`` (default ``os.environ``) is this process's environment,
    ``parent_environ`` its parent's (default: read from /proc; unknown elsewhere, and then
    nothing is refused).
    """
    environ = os.environ if environ is None else environ
    setting = f"{visible_variable}={environ.get(visible_variable, 'unset')}"
    if visible_devices < 1:
        raise UsageError(f"no device is visible to local rank {local_rank} ({setting}); check the job's allocation")
    if visible_devices == 1 and local_world_size > 1 and "TORCHELASTIC_RUN_ID" in environ:
        parent = _parent_environment() if parent_environ is None else parent_environ
        if parent is not None and parent.get(visible_variable) == environ.get(visible_variable):
            raise UsageError(
                f"{local_world_size} torchrun workers on this node would share one device: each inherits "
                f"torchrun's {setting}, which shows one; make {local_world_size} devices visible to torchrun, "
                "or start one worker per node (--nproc-per-node 1)"
            )
    if visible_devices > 1 and local_world_size > visible_devices:
        raise UsageError(
            f"{local_world_size} ranks on this node but {visible_devices} devices visible ({setting}); "
            f"start at most {visible_devices} processes per node, or give each rank its own device "
            "(srun --gpus-per-task=1)"
        )
    return local_rank % visible_devices


def _parent_environment() -> dict[str, str] | None:
    """The environment this process's parent was started with (Linux's /proc); None where unknown."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {name.decode(errors="replace"): value.decode(errors="replace") for name, value in pairs}


# --------------------------------------------------------------------------- explicit flags


def parse_init_method(init_method: str) -> tuple[str, int] | None:
    """``tcp://HOST:PORT`` -> (HOST, PORT); ``env://`` -> None (read MASTER_ADDR/MASTER_PORT)."""
    fix = "use tcp://HOST:PORT of rank 0, e.g. --distributed-init-method tcp://10.0.0.1:29500"
    text = init_method.strip()
    if text == "env://":
        return None
    try:
        parts = urlsplit(text)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise UsageError(f"--distributed-init-method {init_method!r} is malformed; {fix}") from None
    if parts.scheme != "tcp":
        raise UsageError(f"--distributed-init-method {init_method!r}: only tcp:// and env:// are supported; {fix}")
    if not host or port is None or port == 0 or parts.path not in ("", "/") or parts.query:
        raise UsageError(f"--distributed-init-method {init_method!r} needs a host and a port; {fix}")
    return host, port


def _explicit_master(init_method: str, environ: Mapping[str, str]) -> tuple[str, int]:
    parsed = parse_init_method(init_method)
    if parsed is not None:
        return parsed
    addr, port = _master_from_environ(environ)
    if addr is None or port is None:
        raise UsageError("--distributed-init-method env:// needs MASTER_ADDR and MASTER_PORT exported")
    return addr, port


def _merge_explicit(env: ClusterEnv, launcher: type, explicit: ExplicitLaunch, environ: Mapping[str, str]) -> ClusterEnv:
    """A launcher was detected: explicit flags may only repeat it, and may name the master."""
    if explicit.is_empty:
        return env
    world_var = _first_present(environ, launcher.WORLD_VARS) or launcher.WORLD_VARS[0]
    if explicit.rank is not None and explicit.rank != env.rank:
        raise UsageError(
            f"--distributed-rank {explicit.rank} but {launcher.RANK_VAR}={env.rank}; "
            f"drop the flag (the {env.launcher} launcher sets the rank) or make them agree"
        )
    if explicit.world_size is not None and explicit.world_size != env.world_size:
        raise UsageError(
            f"--distributed-world-size {explicit.world_size} but {world_var}={env.world_size}; "
            f"drop the flag (the {env.launcher} launcher sets the world size) or make them agree"
        )
    if explicit.init_method is None:
        return env
    master = parse_init_method(explicit.init_method)
    if master is None:  # env:// -- the launcher already read MASTER_ADDR/MASTER_PORT where it uses them
        return env
    return replace(env, master_addr=master[0], master_port=master[1])


def _explicit_or_single(explicit: ExplicitLaunch, environ: Mapping[str, str]) -> ClusterEnv:
    world_size, rank = explicit.world_size, explicit.rank
    if world_size is not None and world_size < 1:
        raise UsageError(f"--distributed-world-size {world_size} must be at least 1")
    if rank is not None and rank < 0:
        raise UsageError(f"--distributed-rank {rank} must not be negative")
    if explicit.is_empty or (world_size == 1 and rank in (None, 0) and explicit.init_method is None):
        return single_process_env()
    missing = [
        flag
        for flag, value in (
            ("--distributed-world-size", world_size),
            ("--distributed-rank", rank),
            ("--distributed-init-method", explicit.init_method),
        )
        if value is None
    ]
    if missing:
        raise UsageError(
            f"no launcher (torchrun, srun, mpiexec) detected, so an explicit launch needs {', '.join(missing)} "
            "as well; start every rank with all three flags, or use torchrun"
        )
    assert world_size is not None and rank is not None and explicit.init_method is not None
    if rank >= world_size:
        raise UsageError(f"--distributed-rank {rank} must be below --distributed-world-size {world_size}")
    master = _explicit_master(explicit.init_method, environ)
    return ClusterEnv(
        rank=rank,
        world_size=world_size,
        local_rank=0,
        local_world_size=1,
        node_rank=rank,
        num_nodes=world_size,
        master_addr=master[0],
        master_port=master[1],
        launcher="explicit",
        nodes_assumed=_ONE_PER_HOST if world_size > 1 else None,
    )


def single_process_env() -> ClusterEnv:
    """Rank 0 of 1. The port stays None: a process group, if one is ever wanted, lets the OS pick it."""
    return ClusterEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=None,
        launcher="single",
    )


# --------------------------------------------------------------------------- master via MPI


def find_free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close).

    Another process can take it before we bind again; callers that can should pass
    port 0 to the server itself instead (TCPStore does, for a single process).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def routable_address() -> str:
    """An address of this host that other nodes can reach, best effort.

    The hostname's address unless it resolves to loopback (Debian maps the hostname to
    127.0.1.1); then the address of the interface holding the default route (a UDP
    connect sends no packet); the bare hostname as a last resort.
    """
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            address = sock.getsockname()[0]
            if not address.startswith("127.") and address != "0.0.0.0":
                return address
    except OSError:
        pass
    return hostname


def resolve_master_via_mpi(env: ClusterEnv, node_comm: Any = None) -> ClusterEnv:
    """Under mpiexec, fill in what the environment lacks: the master, and the real node of every rank.

    Rank 0 picks its own reachable address and a free port and broadcasts them over
    ``MPI.COMM_WORLD`` (skipped when MASTER_ADDR and MASTER_PORT are exported). Node
    rank, node count, local rank, local size and ``node_of_rank`` come from
    ``mpi_node_layout``, i.e. from the hosts MPI actually placed the ranks on; call it
    on every rank together, before the process group exists. ``node_comm`` is passed
    on to ``mpi_node_layout`` (tests simulate hosts with it). Other launchers: returned
    unchanged when their master is known.
    """
    needs_master = env.master_addr is None or env.master_port is None
    needs_layout = env.launcher == "mpi" and env.node_of_rank is None
    if not (needs_master or needs_layout):
        return env
    try:
        from mpi4py import MPI  # lazy: mpi4py is optional and loads the MPI library
    except ImportError:
        if not needs_master:
            return env  # MASTER_* exported: runs, with the nodes still assumed (env.nodes_assumed)
        raise UsageError(
            f"launcher {env.launcher} gives no master address and mpi4py is not installed: "
            "pip install 'distlm[mpi]' (or pip install mpi4py), or export MASTER_ADDR and MASTER_PORT"
        ) from None
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (env.rank, env.world_size):
        # e.g. mpi4py built against another MPI than the mpiexec that started us: every
        # process is then a world of its own, and would agree with nobody.
        raise UsageError(
            f"mpi4py sees rank {comm.Get_rank()} of {comm.Get_size()} but the launcher set rank {env.rank} of "
            f"{env.world_size}; install mpi4py against the MPI whose mpiexec starts the job"
        )
    if needs_master:
        proposal = (routable_address(), find_free_port()) if env.rank == 0 else None
        master_addr, master_port = comm.bcast(proposal, root=0)
        env = replace(env, master_addr=master_addr, master_port=int(master_port))
    if needs_layout:
        layout = mpi_node_layout(comm, node_comm)
        env = replace(
            env,
            node_rank=layout.node_rank,
            num_nodes=layout.num_nodes,
            local_rank=layout.local_rank,
            local_world_size=layout.local_world_size,
            node_of_rank=layout.node_of_rank,
            nodes_assumed=None,
        )
    return env


# --------------------------------------------------------------------------- nodes under MPI


class NodeLayout(NamedTuple):
    """Which ranks share a host, as every rank of the job sees it."""

    node_rank: int
    num_nodes: int
    local_rank: int
    """Position among the ranks of this node, in world-rank order."""
    local_world_size: int
    node_of_rank: tuple[int, ...]
    """Node index of every world rank; nodes are numbered in the order of their lowest world rank."""


def node_layout(rank: int, node_keys: Sequence[Hashable]) -> NodeLayout:
    """The layout of rank ``rank`` given ``node_keys[r]``, any value naming the node of each rank ``r``.

    Nodes are numbered by their lowest world rank (node 0 holds rank 0, node 1 the lowest
    rank not on node 0, ...), so every rank that sees the same keys computes the same
    numbering, whatever the keys are.
    """
    numbering: dict[Hashable, int] = {}
    for key in node_keys:
        numbering.setdefault(key, len(numbering))
    node_of_rank = tuple(numbering[key] for key in node_keys)
    node = node_of_rank[rank]
    return NodeLayout(
        node_rank=node,
        num_nodes=len(numbering),
        local_rank=node_of_rank[:rank].count(node),
        local_world_size=node_of_rank.count(node),
        node_of_rank=node_of_rank,
    )


def mpi_node_layout(comm: Any, node_comm: Any = None) -> NodeLayout:
    """Which ranks of the mpi4py communicator ``comm`` share a host; call on every rank together.

    The host is ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``: the ranks that share
    memory, i.e. the node MPI really placed them on, whatever the mapping (``--map-by
    node`` places ranks round-robin, so rank // ranks-per-node is not the node).
    ``OMPI_COMM_WORLD_NODE_RANK`` is not used: it is a rank on the node counted across
    jobs, not the node index. ``node_comm``, the communicator of the ranks sharing this
    rank's node, replaces that split when given (tests simulate several hosts on one
    machine with ``comm.Split(color=fake_host)``); it is read only when passed.
    """
    from mpi4py import MPI  # comm is an mpi4py communicator, so mpi4py is there

    rank = comm.Get_rank()
    split_here = node_comm is None
    if split_here:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        # Every rank names its node by the node's lowest world rank (agreed within the
        # node), then all ranks exchange those names: two small collectives, once.
        node_leader = node_comm.allreduce(rank, op=MPI.MIN)
        node_keys = comm.allgather(node_leader)
    finally:
        if split_here:
            node_comm.Free()
    return node_layout(rank, node_keys)


def ranks_by_node(node_of_rank: Sequence[int]) -> list[list[int]]:
    """World ranks on each node, node by node, each list ascending: (0, 1, 0, 1) -> [[0, 2], [1, 3]].

    With equal ranks per node this is the (nodes, ranks per node) rank grid of a
    hierarchical all-reduce: rows are the intra-node groups, columns the inter-node ones
    (``DeviceMesh(device, torch.tensor(ranks_by_node(...)), mesh_dim_names=("node", "local"))``).
    """
    nodes: list[list[int]] = [[] for _ in range(max(node_of_rank, default=-1) + 1)]
    for rank, node in enumerate(node_of_rank):
        nodes[node].append(rank)
    return nodes


# --------------------------------------------------------------------------- nodes from the hosts


class Host(NamedTuple):
    """The host a process runs on, as every rank can compare it."""

    name: str
    boot_id: str
    """This boot of this machine; a host name alone repeats across containers and images."""
    netns: int
    """The network namespace's inode: processes of one machine that reach each other only over
    the network (containers, pods, simulated nodes) are separate hosts."""


def boot_id() -> str | None:
    """This boot of this machine (Linux), None elsewhere."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def this_host() -> Host:
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return Host(socket.gethostname(), boot_id() or "", netns)


def place_by_hosts(env: ClusterEnv, hosts: Sequence[Host], launcher_nodes: Sequence[int]) -> tuple[ClusterEnv, str]:
    """``env`` with its node checked against, or taken from, the host of every rank; and a log line.

    ``hosts[r]`` and ``launcher_nodes[r]`` are rank r's ``this_host()`` and ``node_rank`` as
    its launcher gave it, all-gathered at start. Where the launcher does not say which
    ranks share a node (``env.nodes_assumed``: fairseq's flags and ``env://`` assume one
    process per host, torchrun variables without ``GROUP_RANK`` consecutive ranks), the
    hosts decide: node, local rank and ``node_of_rank`` become theirs, nodes numbered by
    their lowest rank. Where the launcher does say, the ranks it puts on one node must run
    on one host, else a one-line ``UsageError`` (every rank raises it alike): grouping them
    would send a hierarchical hook's intra-node leg over the network. Several of its nodes
    on one host are accepted: that is how several agents on one machine (and the tests'
    stand-ins) simulate nodes, and it only forgoes shared memory, never correctness.
    """
    if len(hosts) != env.world_size or len(launcher_nodes) != env.world_size:
        raise ValueError(f"one host and node per rank: {len(hosts)}, {len(launcher_nodes)} for {env.world_size} ranks")

    def listing(ranks: Sequence[int], most: int = 3) -> str:
        groups: dict[Host, list[int]] = {}
        for rank in ranks:
            groups.setdefault(hosts[rank], []).append(rank)
        shown = [f"{host.name}: {describe_ranks(members)}" for host, members in list(groups.items())[:most]]
        more = f" and {len(groups) - most} more" if len(groups) > most else ""
        return "; ".join(shown) + more

    found = node_layout(env.rank, hosts)
    if env.nodes_assumed is not None:
        placed = replace(env, node_rank=found.node_rank, num_nodes=found.num_nodes, local_rank=found.local_rank,
                         local_world_size=found.local_world_size, node_of_rank=found.node_of_rank,
                         nodes_assumed=None)
        return placed, (f"{found.num_nodes} node{'s' if found.num_nodes > 1 else ''} found from the hosts "
                        f"({listing(range(env.world_size))}); launcher {env.launcher} does not say which ranks "
                        "share a node")
    claimed: dict[int, list[int]] = {}
    for rank, node in enumerate(launcher_nodes):
        claimed.setdefault(node, []).append(rank)
    for node, ranks in claimed.items():
        if len({hosts[rank] for rank in ranks}) > 1:
            raise UsageError(
                f"launcher {env.launcher} puts {describe_ranks(ranks)} on node {node}, but they run on "
                f"{len({hosts[rank] for rank in ranks})} hosts ({listing(ranks)}); the ranks of a node must share "
                "a host: start one launcher per host (torchrun --node-rank, srun --ntasks-per-node) or correct "
                "the node variables exported by hand"
            )
    return env, (f"{len(claimed)} node{'s' if len(claimed) > 1 else ''} from launcher {env.launcher}, on "
                 f"{found.num_nodes} host{'s' if found.num_nodes > 1 else ''} ({listing(range(env.world_size))})")
