"""The distributed context of a run: who this process is, on which device, in which layout.

``init_distributed(config)`` detects the launcher, validates the whole configuration
against it and the hardware (before any rendezvous, so bad input fails in a second on
every rank alike), applies the hardware backend's presets, starts the process group and
builds the ``ParallelDims`` meshes. The Trainer receives the resulting ``DistContext``
and never touches launchers or backends itself.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from distlm.attempt_store import current_attempt
from distlm.backends import Backend, get_backend
from distlm.backends.base import uses_agent_store
from distlm.builder import ModelSpec
from distlm.compile import use_compile_cache
from distlm.config import TrainConfig
from distlm.env import ClusterEnv, ExplicitLaunch, node_layout, place_by_hosts, resolve_master_via_mpi, this_host
from distlm.errors import first_line
from distlm.heartbeat import Heartbeat, current_heartbeat, start_heartbeat, stop_heartbeat
from distlm.mesh import ParallelDims
from distlm.signals import die_with_torchrun_agent
from distlm.parallel.api import ParallelOptions
from distlm.parallel.pipeline import options_from_config as pipeline_options
from distlm.validation import validate_run

logger = logging.getLogger("distlm")


class CollectiveFailure(RuntimeError):
    """A collective did not complete: a peer died, stalled past --timeout-sec, or lost its link."""


@dataclass
class DistContext:
    """This process's place in the job, its device and the layout's process groups."""

    env: ClusterEnv
    backend: Backend
    device: torch.device
    dims: ParallelDims
    timeout: datetime.timedelta
    heartbeat: Heartbeat | None = None
    """Side channel naming the ranks a hung collective waits for; None in a single process."""
    spec: ModelSpec | None = None
    """The ``--arch``/``--init-from-hf`` model validation checked; None for a user's model."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.env.world_size > 1

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group; None in a single process."""
        return self.dims.dp_group(self.device.type)

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank; None in a single process."""
        return dist.group.WORLD if self.is_distributed else None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.dims.tp_group(self.device.type)

    @property
    def dp_rank(self) -> int:
        return self.dims.coordinates(self.env.rank)[0]

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.dims.dp, "tp": self.dims.tp, **({"pp": self.dims.pp} if self.dims.pp_enabled else {}),
                **({"ep": self.dims.ep} if self.dims.ep_enabled else {})}

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (collective over the world)."""
        if not self.is_distributed:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def node_of_rank(self) -> tuple[int, ...]:
        """The node every rank runs on, numbered by each node's lowest rank (collective).

        Under MPI the launcher found it from the hosts themselves; other launchers give
        each rank its node index, gathered here.
        """
        if self.env.node_of_rank is not None:
            return tuple(self.env.node_of_rank)
        return node_layout(self.rank, self.all_gather_object(self.env.node_rank)).node_of_rank

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (collective over the world)."""
        if not self.is_distributed:
            return flag
        found = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(found)
        return bool(found.item())

    @contextlib.contextmanager
    def naming_failed_collectives(self, update: int) -> Iterator[None]:
        """Run one update's collectives; a transport error inside becomes one line naming the
        ranks that did not arrive and how far each got (from the heartbeat side channel)."""
        if self.heartbeat is not None:
            self.heartbeat.entered = update
        try:
            yield
        except CollectiveFailure:
            raise  # named already, by the same context around a part of this update (a save)
        except RuntimeError as err:
            cause = first_line(err)
            transport = isinstance(err, dist.DistError) or any(
                word in cause.lower() for word in ("timed out", "timeout", "connection", "gloo", "nccl")
            )
            if not self.is_distributed or not transport:
                raise
            missing = (self.heartbeat.describe_missing(update) if self.heartbeat is not None
                       else "the ranks cannot be asked (no heartbeat side channel)")
            raise CollectiveFailure(
                f"rank {self.rank}: a collective of update {update} did not complete "
                f"(--timeout-sec {self.timeout.total_seconds():g}): {missing}. Cause: {cause}"
            ) from err
        if self.heartbeat is not None:
            self.heartbeat.completed = max(self.heartbeat.completed, update)

    def close(self) -> None:
        """Let gloo's worker thread release the last collective before the process may exit:
        a barrier blocks with the GIL released until every rank arrives (the abort it avoids
        is described at ``distlm.errors.exit_without_teardown``)."""
        self.barrier()


def init_distributed(config, model: torch.nn.Module | None = None) -> DistContext:
    """Launcher, validation, backend presets, process group and meshes, in that order.

    ``config`` is a ``distlm.config.TrainConfig``; ``model`` the user's own model, if
    any, validated in place of ``--arch``. An existing process group (the caller's own,
    or an earlier run's in the same process) is reused.
    """
    settings = config.distributed
    env = ClusterEnv.detect(
        explicit=ExplicitLaunch(
            world_size=settings.distributed_world_size,
            rank=settings.distributed_rank,
            init_method=settings.distributed_init_method,
        )
    )
    if env.launcher == "mpi" and env.is_distributed:
        env = resolve_master_via_mpi(env)  # mpiexec exports no master address
    if env.launcher == "torchelastic":
        die_with_torchrun_agent()  # also for the tools and the Python API; train.py asked already
    backend = get_backend(settings.device)
    dims, spec = validate_run(config, env, backend, model)
    if config.compile.compile_cache:
        # Before the device runtime starts: XLA's persistent cache and Neuron's compiler
        # read their variables once, when it does.
        use_compile_cache(config.compile.compile_cache, backend.compile_cache_variables)
    backend.setup(env, config.precision_mode, settings.network)
    timeout = datetime.timedelta(seconds=settings.timeout_sec)
    heartbeat = current_heartbeat()
    if env.is_distributed and not dist.is_initialized():
        # Before the process group starts: NCCL reads these when its communicators are made
        # (a single process has none, so nothing to record and no directory to make).
        backend.record_collectives(str(Path(config.checkpoint.save_dir) / "comm_traces"))
        backend.init_process_group(env, timeout)
        heartbeat = _start_heartbeat(env, timeout)
    # After the process group: a PJRT device learns its place in the job from it. From the
    # launcher's local rank, as setup() chose it: the hosts are known only after a collective.
    device = backend.device(env)
    hosts_line = None
    if env.is_distributed:
        env, hosts_line = _place_by_hosts(env, heartbeat)
    context = DistContext(env=env, backend=backend, device=device, dims=dims, timeout=timeout, heartbeat=heartbeat,
                          spec=spec)
    if context.is_main:
        # The launcher's line opens the log (fairseq's order), the hosts' findings follow it.
        logger.info("%s; device %s, layout %s, strategy %s", env.describe(), device, describe_layout(context.layout),
                    dims.strategy)
        if hosts_line:
            logger.info("%s", hosts_line)
    return context


def describe_layout(layout: Any) -> str:
    """A layout (``DistContext.layout``) as the log lines say it, ``pp 2 x dp 1 x tp 1``;
    ``unrecorded`` for what a checkpoint holds that is not one."""
    if not isinstance(layout, dict) or not layout:
        return "unrecorded"
    first = [name for name in ("pp", "dp", "tp") if name in layout]
    return " x ".join(f"{name} {layout[name]}" for name in first + sorted(set(layout) - set(first)))


def parallel_options(config: TrainConfig, ctx: DistContext) -> ParallelOptions:
    """The command line's distributed settings as the plain values ``parallelize`` takes."""
    settings = config.distributed
    return ParallelOptions(
        precision=config.precision_mode, sequence_parallel=settings.sequence_parallel,
        activation_checkpointing=settings.activation_checkpointing, bucket_cap_mb=settings.bucket_cap_mb,
        comm_hook=settings.comm_hook, comm_transport=settings.comm_transport,
        double_buffering=settings.double_buffering, ranks_per_node=settings.ranks_per_node,
        cpu_offload=settings.cpu_offload,
        node_of_rank=ctx.node_of_rank() if settings.comm_hook.startswith("hierarchical") else None,
        compile_backend=ctx.backend.compile_backend if config.compile.compile else None,
        foreach_clip=ctx.backend.foreach_clip, pipeline=pipeline_options(settings),
        grouped_mm=ctx.backend.grouped_mm,
    )


def _place_by_hosts(env: ClusterEnv, heartbeat: Heartbeat | None = None) -> tuple[ClusterEnv, str]:
    """Every rank's host, all-gathered once at start: the nodes where the launcher does not say
    them, a one-line refusal where it says something the hosts contradict (``place_by_hosts``),
    and the line saying what was found. The heartbeat keeps the hosts' names, to name the
    hosts of ranks lost later."""
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, (this_host(), env.node_rank))
    if heartbeat is not None:
        heartbeat.hosts = [host.name for host, _ in gathered]
    return place_by_hosts(env, [host for host, _ in gathered], [node for _, node in gathered])


def _start_heartbeat(env: ClusterEnv, timeout: datetime.timedelta) -> Heartbeat | None:
    """A beat a tenth of the timeout apart (0.1-2 s): a failed collective names its
    missing ranks within a few beats of the timeout."""
    if not env.is_distributed or env.master_addr is None or env.master_port is None:
        return None
    interval = min(2.0, max(0.1, timeout.total_seconds() / 10))
    agent_store = uses_agent_store(env, os.environ)
    # In torchrun's store, which outlives restarts, each attempt's beats are kept apart by
    # the attempt's id (the restart count differs between nodes: distlm/attempt_store.py).
    attempt = current_attempt() if agent_store else None
    try:
        return start_heartbeat(env.master_addr, env.master_port, env.rank, env.world_size, interval,
                               restart=attempt or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                               store_host=None if agent_store else 0)
    except (RuntimeError, dist.DistStoreError) as err:
        logger.warning("rank %d: no heartbeat side channel (%s); a hung collective will not name its ranks",
                       env.rank, err)
        return None


def shutdown() -> None:
    """End this process's part of the job: the heartbeat, then the process group."""
    stop_heartbeat()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
