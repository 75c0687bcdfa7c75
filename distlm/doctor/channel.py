"""How the doctor's ranks exchange what they found, without ever hanging on a missing rank.

Every exchange is a monitored barrier followed by an ``all_gather_object``, both over a
gloo group and bounded by ``--timeout-sec``. gloo's ``monitored_barrier`` lets rank 0
name each rank that did not arrive in time, which a plain collective cannot: a rank
stuck in its own probe (a hung NFS mount, a wedged driver) or dead is named in the
table instead of every rank waiting forever. NCCL and Neuron groups get a gloo group of
their own for this, since ``monitored_barrier`` is gloo's.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import torch.distributed as dist

from distlm.doctor.report import format_ranks
from distlm.errors import first_line

_LATE_RANKS = re.compile(r"Ranks? ([\d,\s]+?) failed to pass monitoredBarrier")


class StepFailed(RuntimeError):
    """A step did not complete on every rank within the timeout; the message names whom it waited for."""


class RankChannel:
    """Gathers among all ranks; each fails with ``StepFailed`` naming the late ranks after ``timeout``."""

    def __init__(self, rank: int, world_size: int, timeout: datetime.timedelta, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.group = group

    @classmethod
    def for_context(cls, context: Any) -> "RankChannel":
        """The channel of a ``DistContext``: its world group when that is gloo, else a new gloo group."""
        group = None
        if context.is_distributed and dist.get_backend() != "gloo":
            try:
                group = dist.new_group(backend="gloo", timeout=context.timeout)
            except RuntimeError as err:
                raise StepFailed(
                    f"rank {context.rank} could not create the gloo group the doctor talks over: {first_line(err)}"
                ) from err
        return cls(context.rank, context.world_size, context.timeout, group)

    @property
    def timeout_sec(self) -> float:
        return self.timeout.total_seconds()

    def wait_for_all(self, step: str) -> None:
        """Return once every rank has reached ``step``; ``StepFailed`` naming the others otherwise."""
        if self.world_size == 1:
            return
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            raise StepFailed(self._describe_late(step, err)) from err

    def gather(self, obj: Any, step: str) -> list[Any]:
        """``obj`` of every rank, in rank order, once every rank has reached ``step``."""
        if self.world_size == 1:
            return [obj]
        self.wait_for_all(step)
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, obj, group=self.group)
        except RuntimeError as err:
            raise StepFailed(
                f"the exchange of '{step}' failed on rank {self.rank} after every rank had arrived "
                f"(--timeout-sec {self.timeout_sec:g}): {first_line(err)}"
            ) from err
        return gathered

    def _describe_late(self, step: str, err: RuntimeError) -> str:
        message = str(err)
        late = _LATE_RANKS.search(message)
        if self.rank == 0 and late is not None:
            ranks = [int(token) for token in re.findall(r"\d+", late.group(1))]
            noun = "rank" if len(ranks) == 1 else "ranks"
            return (
                f"{noun} {format_ranks(ranks)} did not reach '{step}' within --timeout-sec {self.timeout_sec:g}: "
                "stalled, died, or cannot reach rank 0 (their own output says why)"
            )
        if self.rank != 0 and "from rank 0" in message:
            return (
                f"rank {self.rank}: rank 0 did not confirm within --timeout-sec {self.timeout_sec:g} that every "
                f"rank reached '{step}': rank 0 stalled or died, or another rank is missing (rank 0's table names it)"
            )
        return (
            f"rank {self.rank}: '{step}' did not complete within --timeout-sec {self.timeout_sec:g}: "
            f"{first_line(err)}"
        )
