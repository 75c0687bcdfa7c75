"""``DistContext``: this process's place in the job (rank, world, node), its device, backend and
meshes, whose node axis holds the node of every rank; no model. What needs only a rank, a gather
or a barrier (the checkpointer, the observer, the validator, the trackers) takes this and
nothing above it.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from distlm.backends.base import Backend
from distlm.errors import first_line
from distlm.launch.cluster_env import ClusterEnv
from distlm.mesh import ParallelDims
from distlm.runtime.heartbeat import Heartbeat, stop_heartbeat

# torch 2.13 renamed it (the old name warns); older releases (Neuron's torch-xla stacks)
# know only the old one. Same arguments.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def describe_layout(layout: Any) -> str:
    """A layout (``DistContext.layout``) as the log lines say it, ``pp 2 x dp 1 x tp 1``;
    ``unrecorded`` for what a checkpoint holds that is not one."""
    if not isinstance(layout, dict) or not layout:
        return "unrecorded"
    first = [name for name in ("pp", "dp", "tp") if name in layout]
    return " x ".join(f"{name} {layout[name]}" for name in first + sorted(set(layout) - set(first)))


def shutdown() -> None:
    """End this process's part of the job: the heartbeat, then the process group."""
    stop_heartbeat()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
