"""Ranks started by an MPI's ``mpiexec`` (OpenMPI, MPICH, Intel MPI), and what MPI itself must tell:
the master address, and which ranks share a host."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from distlm.errors import UsageError
from distlm.launch.cluster_env import ClusterEnv, ceil_div, check_at_most, check_below, master_from_environ, read_int
from distlm.launch.hosts import NodeLayout, find_free_port, node_layout, routable_address


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
    world_size = read_int(environ, size_var, minimum=1)
    rank = read_int(environ, rank_var)
    check_below(rank, rank_var, world_size, size_var)
    for name in local:
        if name not in environ:
            raise UsageError(
                f"{rank_var} is set but {name} is not; launch with the MPI's own mpiexec (which sets it) or with torchrun"
            )
    local_world_size = read_int(environ, local_size_var, minimum=1)
    check_at_most(local_world_size, local_size_var, world_size, size_var)
    local_rank = read_int(environ, local_rank_var)
    check_below(local_rank, local_rank_var, local_world_size, local_size_var)
    # MPI exports no node index. rank // ranks-per-node is right for mpiexec's default
    # by-slot mapping only (--map-by node places ranks round-robin); it stands in until
    # resolve_master_via_mpi() asks MPI which ranks share a host (mpi_node_layout), and is
    # marked as assumed unless every rank is local.
    # mpiexec sets no master either: None until resolve_master_via_mpi() agrees on one.
    master_addr, master_port = master_from_environ(environ)
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
        num_nodes=ceil_div(world_size, local_world_size),
        master_addr=master_addr,
        master_port=master_port,
        launcher="mpi",
        nodes_assumed=None if local_world_size == world_size else (
            f"{size_var} and {local_size_var} say how many ranks, not which share a host; install mpi4py "
            "(pip install 'distlm[mpi]') so that distlm asks MPI"
        ),
    )


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
