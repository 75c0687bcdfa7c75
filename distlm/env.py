"""Who am I in the job? Rank, world size, local rank and master address from the launcher.

``ClusterEnv.detect()`` asks each launcher in a fixed order -- TorchElastic (torchrun),
Slurm (srun), MPI (OpenMPI, then MPICH/Intel MPI) -- and the first that recognises its
variables describes this process. fairseq-style flags (``--distributed-rank`` and
friends) come next: they fill in a launch nobody else describes, or must agree with the
launcher that does. Nothing at all means one process.

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
from dataclasses import dataclass, replace
from typing import Mapping
from urllib.parse import urlsplit

from distlm.errors import UsageError

LAUNCHER_NAMES = ("torchelastic", "slurm", "mpi", "explicit", "single")

# Slurm runs these job names for interactive allocations (salloc's default shell,
# `srun --pty bash`); a Python started by hand in such a shell is not an srun task.
_SLURM_INTERACTIVE_JOB_NAMES = ("bash", "interactive")

# Derived Slurm ports live in [10000, 30000): below Linux's ephemeral range
# (32768-60999) so they never clash with ports the kernel hands to outgoing connections.
_SLURM_PORT_BASE = 10000
_SLURM_PORT_SPAN = 20000


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

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @staticmethod
    def detect(
        environ: Mapping[str, str] | None = None,
        explicit: ExplicitLaunch | None = None,
    ) -> "ClusterEnv":
        """The first launcher that recognises ``environ`` (default ``os.environ``), merged with ``explicit``."""
        environ = os.environ if environ is None else environ
        explicit = explicit if explicit is not None else ExplicitLaunch()
        for launcher in LAUNCHERS:
            env = launcher.detect(environ)
            if env is not None:
                return _merge_explicit(env, launcher, explicit, environ)
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


def slurm_master_port(job_id: int) -> int:
    """A port every task of a job agrees on without talking: a function of the job id.

    A fixed default port (29500) collides as soon as two jobs share a node; the job id
    differs between concurrent jobs, so their ports differ too (unless their ids differ
    by a multiple of 20000, which concurrent jobs practically never do).
    """
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN


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
        node_rank = node_rank if node_rank is not None else rank // local_world_size
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
        )


class SlurmLauncher:
    """Tasks started by ``srun`` (not the batch script's shell, not an interactive shell)."""

    RANK_VAR = "SLURM_PROCID"
    # srun exports the step's own task count; SLURM_NTASKS may describe the allocation.
    WORLD_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    NUM_NODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
        # An sbatch script's shell also has SLURM_PROCID=0 and SLURM_NTASKS=N, but no
        # step id: only srun starts a step. Treating that shell as rank 0 of N would
        # make a `python train.py` in the script wait forever for N-1 peers.
        if "SLURM_PROCID" not in environ:
            return None
        if "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ:
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
            master_port = slurm_master_port(_read_int(environ, "SLURM_JOB_ID"))
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
    # MPI exports no node index. With mpiexec's default by-slot mapping, ranks fill a
    # node before moving to the next, so the node is rank // ranks-per-node. Other
    # mappings (--map-by node, round-robin) break this; hierarchical all-reduce, the one
    # user of node_rank, needs by-slot mapping and equal ranks per node anyway.
    # mpiexec sets no master: None until resolve_master_via_mpi() agrees on one.
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
    )


# Fixed order: torchrun's variables are the most specific (srun torchrun ... sets both
# torchrun's and Slurm's), then Slurm, then MPI (whose daemons may carry Slurm's).
LAUNCHERS = (TorchElasticLauncher, SlurmLauncher, OpenMPILauncher, MPICHLauncher)


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


def resolve_master_via_mpi(env: ClusterEnv) -> ClusterEnv:
    """Fill in the master address and port under mpiexec, which sets neither.

    Rank 0 picks its own reachable address and a free port and broadcasts them over
    ``MPI.COMM_WORLD``. A no-op when the master is already known (MASTER_ADDR and
    MASTER_PORT exported, or another launcher).
    """
    if env.master_addr is not None and env.master_port is not None:
        return env
    try:
        from mpi4py import MPI  # lazy: mpi4py is optional and loads the MPI library
    except ImportError:
        raise UsageError(
            f"launcher {env.launcher} gives no master address and mpi4py is not installed: "
            "pip install 'distlm[mpi]' (or pip install mpi4py), or export MASTER_ADDR and MASTER_PORT"
        ) from None
    comm = MPI.COMM_WORLD
    proposal = (routable_address(), find_free_port()) if env.rank == 0 else None
    master_addr, master_port = comm.bcast(proposal, root=0)
    return replace(env, master_addr=master_addr, master_port=int(master_port))
