"""``ClusterEnv``: this process's place in the job, the same whatever launcher described it,
and the readers every launcher reads its variables with (each names the variable it refuses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from distlm.errors import UsageError

LAUNCHER_NAMES = ("torchelastic", "slurm", "mpi", "env", "explicit", "single")


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


def read_int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int:
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


def read_optional_int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    return read_int(environ, name, minimum) if name in environ else None


def read_port(environ: Mapping[str, str], name: str) -> int:
    port = read_int(environ, name, minimum=1)
    if port > 65535:
        raise UsageError(f"{name}={port} is not a TCP port (1-65535); fix or unset it")
    return port


def first_present(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in environ), None)


def check_below(value: int, value_name: str, bound: int, bound_name: str) -> None:
    if value >= bound:
        raise UsageError(f"{value_name}={value} must be below {bound_name}={bound}; the launch is inconsistent")


def check_at_most(value: int, value_name: str, bound: int, bound_name: str) -> None:
    if value > bound:
        raise UsageError(f"{value_name}={value} exceeds {bound_name}={bound}; the launch is inconsistent")


def master_from_environ(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = environ.get("MASTER_ADDR") or None
    port = read_port(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None
    return addr, port


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
