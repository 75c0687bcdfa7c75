"""Bare ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` exports (``env://``, a Kubeflow
PyTorchJob): one process per host."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from distlm.errors import UsageError
from distlm.launch.cluster_env import ClusterEnv, check_below, master_from_environ, read_int, read_optional_int

ONE_PER_HOST = "each process is assumed to run on a host of its own (nothing exports a local rank)"


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
        world_size = read_int(environ, "WORLD_SIZE", minimum=1)
        rank = read_int(environ, "RANK")
        check_below(rank, "RANK", world_size, "WORLD_SIZE")
        if "LOCAL_RANK" in environ:  # torchrun's set, which TorchElasticLauncher takes when MASTER_ADDR is there
            raise UsageError(
                "RANK, WORLD_SIZE and LOCAL_RANK are set but MASTER_ADDR is not; "
                "export MASTER_ADDR and MASTER_PORT (rank 0's address and a free port), or launch with torchrun"
            )
        local_world_size = read_optional_int(environ, "LOCAL_WORLD_SIZE", minimum=1)
        if local_world_size not in (None, 1):
            raise UsageError(
                f"LOCAL_WORLD_SIZE={local_world_size} is set but LOCAL_RANK is not; export LOCAL_RANK for "
                "each process (torchrun does), or unset LOCAL_WORLD_SIZE for one process per host"
            )
        master_addr, master_port = master_from_environ(environ)
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
            nodes_assumed=ONE_PER_HOST if world_size > 1 else None,
        )


def require_env_master(env: ClusterEnv) -> ClusterEnv:
    """The env launcher after explicit flags: the master must be known by now (flags may name it)."""
    if env.master_addr is not None:
        return env
    if env.is_distributed:
        raise UsageError(
            "RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT are not; export both "
            "(rank 0's address and a free port), or pass --distributed-init-method tcp://HOST:PORT"
        )
    return replace(env, master_addr="127.0.0.1")  # one process: as single_process_env()
