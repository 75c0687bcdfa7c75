"""Which rank is slow: every rank's own time per log interval, gathered in one collective.

In synchronous data parallelism every rank's wall-clock step is the slowest rank's, so a
rank's own time leaves out what it spends waiting for the others: its step time is its
data wait (blocked on the loader) plus its compute (the update minus its wait for its
peers at the update's first collective, where ranks with their batch ready wait for the
late ones). A rank slow inside the backward pass is hidden by the gradient all-reduce,
which every rank leaves together; a rank slow to produce its batch, or in anything it
does between two updates, is found. Timings are the host's: on CUDA they include the
kernels only where the host waits for them.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from typing import Iterator

import torch
import torch.distributed as dist

from distlm.observe.printer import significant
from distlm.runtime.context import all_gather_tensor

logger = logging.getLogger("distlm")

SLOW_FACTOR = 1.2
"""A rank whose step time exceeds the median by this factor ..."""
SLOW_INTERVALS = 3
"""... for this many log intervals in a row is named in a warning."""
DATA_WAIT_SHARE = 0.05
"""Data waits above this share of a rank's step time are reported (once)."""


class StepTiming:
    """This rank's data wait and compute since the last log line; ``interval_fields`` gathers every rank's."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None, num_workers: int):
        self.rank, self.world_size, self.group, self.num_workers = rank, world_size, group, num_workers
        self.slow_streak = [0] * world_size
        self.named: set[int] = set()
        self.data_wait_said = False
        self.intervals = 0
        self._reset()

    def _reset(self) -> None:
        self.data_wait = self.compute = self.peer_wait = 0.0
        self.updates = 0

    def next_batch(self, batches: Iterator):
        with self._adding_time_to("data_wait"):
            return next(batches)

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """Around one update."""
        self.updates += 1
        return self._adding_time_to("compute")

    def waiting_for_peers(self) -> contextlib.AbstractContextManager[None]:
        """Around the update's first collective, where ranks with their batch wait for the others."""
        return self._adding_time_to("peer_wait")

    @contextlib.contextmanager
    def _adding_time_to(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - started)

    def interval_fields(self) -> dict[str, float | int]:
        """Collective over the world when distributed: the train line's straggler fields
        (none in a single process), with the warnings they call for on rank 0."""
        own = torch.tensor([max(self.compute - self.peer_wait, 0.0), self.data_wait], dtype=torch.float64)
        updates = max(self.updates, 1)
        self.intervals += 1
        self._reset()
        if self.group is None:
            self._check_data_wait([own.tolist()], updates)
            return {}
        every = torch.empty(self.world_size * 2, dtype=torch.float64)
        all_gather_tensor(every, own, group=self.group)
        times = every.view(self.world_size, 2).tolist()
        steps = [compute + wait for compute, wait in times]
        median = statistics.median(steps)
        slowest = max(range(self.world_size), key=steps.__getitem__)
        ratio = steps[slowest] / median if median > 0 else 1.0
        if self.rank == 0:
            self._check_slow_ranks(steps, median, times, updates)
            self._check_data_wait(times, updates)
        return {"slowest_rank": slowest, "step_time_max_over_median": significant(ratio, 4)}

    def _check_slow_ranks(self, steps: list[float], median: float, times: list[list[float]], updates: int) -> None:
        for rank, step in enumerate(steps):
            slow = median > 0 and step > SLOW_FACTOR * median
            self.slow_streak[rank] = self.slow_streak[rank] + 1 if slow else 0
            if self.slow_streak[rank] >= SLOW_INTERVALS and rank not in self.named:
                self.named.add(rank)
                compute, wait = times[rank]
                logger.warning(
                    "rank %d is a straggler: its step took %.2fx the median of all ranks for %d log intervals in a row "
                    "(now %.3f s per update: compute %.3f s, data wait %.3f s); every rank waits for it",
                    rank, step / median, SLOW_INTERVALS, step / updates, compute / updates, wait / updates)

    def _check_data_wait(self, times: list[list[float]], updates: int) -> None:
        if self.data_wait_said or self.intervals == 1:
            return  # the first interval waits for the loader to start, which says nothing of later updates
        shares = [wait / (compute + wait) if compute + wait > 0 else 0.0 for compute, wait in times]
        worst = max(range(len(shares)), key=shares.__getitem__)
        if shares[worst] > DATA_WAIT_SHARE:
            self.data_wait_said = True
            logger.warning(
                "rank %d waits for data %.0f %% of its step (%.3f s per update); load batches in parallel with "
                "more --num-workers (now %d)", worst, 100 * shares[worst], times[worst][1] / updates, self.num_workers)
