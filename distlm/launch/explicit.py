"""fairseq's launch flags (``--distributed-world-size``, ``--distributed-rank``,
``--distributed-init-method``): a process the user starts once per rank, or flags that must
agree with the launcher that started it."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping
from urllib.parse import urlsplit

from distlm.errors import UsageError
from distlm.launch.cluster_env import ClusterEnv, ExplicitLaunch, first_present, master_from_environ, single_process_env
from distlm.launch.env_vars import ONE_PER_HOST


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
    addr, port = master_from_environ(environ)
    if addr is None or port is None:
        raise UsageError("--distributed-init-method env:// needs MASTER_ADDR and MASTER_PORT exported")
    return addr, port


def merge_explicit(env: ClusterEnv, launcher: type, explicit: ExplicitLaunch, environ: Mapping[str, str]) -> ClusterEnv:
    """A launcher was detected: explicit flags may only repeat it, and may name the master."""
    if explicit.is_empty:
        return env
    world_var = first_present(environ, launcher.WORLD_VARS) or launcher.WORLD_VARS[0]
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


def explicit_or_single(explicit: ExplicitLaunch, environ: Mapping[str, str]) -> ClusterEnv:
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
        nodes_assumed=ONE_PER_HOST if world_size > 1 else None,
    )
