"""``--profile-steps A:B``: torch.profiler over updates A to B on every rank, one trace per rank.

Each rank writes ``rank<R>.json`` (Chrome/Perfetto trace format, chrome://tracing or
ui.perfetto.dev); rank 0 logs the operators that took the most self time. Each update in
the window is a ``update <N>`` range in the trace. With ``--memory-snapshot`` on CUDA the
allocator's history over the window is dumped for pytorch.org/memory_viz, and again on an
out-of-memory error, whose message then names the file.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from distlm.errors import UsageError, first_line

logger = logging.getLogger("distlm")

TOP_OPERATORS = 15


def parse_profile_steps(text: str) -> tuple[int, int]:
    """``A:B`` -> (A, B), 1 <= A <= B; one line naming the flag otherwise."""
    first, sep, last = text.partition(":")
    try:
        window = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        window = (0, 0)
    if not 1 <= window[0] <= window[1]:
        raise UsageError(f"--profile-steps takes A:B, the first and last update to record (1 <= A <= B), got {text!r}")
    return window


class ProfileWindow:
    """Starts the profiler before update A and writes the traces after update B."""

    def __init__(self, window: tuple[int, int] | None, directory: Path, rank: int, device_type: str,
                 memory_snapshot: bool):
        self.window, self.directory, self.rank, self.device_type = window, directory, rank, device_type
        self.memory_snapshot = memory_snapshot and device_type == "cuda"
        self.profiler: profile | None = None
        if memory_snapshot and device_type != "cuda" and rank == 0:
            logger.info("--memory-snapshot: the allocator history exists on CUDA only; none on %s", device_type)
        if memory_snapshot and window is None and rank == 0:
            logger.info("--memory-snapshot records during --profile-steps, and on out-of-memory errors")
        if self.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    @contextlib.contextmanager
    def update(self, number: int) -> Iterator[None]:
        """Around one update: profiled when ``number`` is in the window."""
        if self.window is not None and number == self.window[0] and self.profiler is None:
            self._start()
        try:
            if self.profiler is None:
                yield
            else:
                with record_function(f"update {number}"):
                    yield
        except torch.OutOfMemoryError as err:
            if not self.memory_snapshot:
                raise
            path = self._dump_memory(f"oom_rank{self.rank}_update{number}")
            snapshot = f" (memory snapshot: {path})" if path is not None else ""
            raise torch.OutOfMemoryError(f"{first_line(err)}{snapshot}") from None
        if self.profiler is not None and number >= self.window[1]:
            self.stop()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.start()

    def stop(self) -> None:
        """End the window now (also at the end of a run that stops inside it)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        trace = self.directory / f"rank{self.rank}.json"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Python's writer: the default (Kineto's) says nothing when it cannot write the file.
            profiler.export_chrome_trace(str(trace), use_python_export=True)
        except OSError as err:
            logger.warning("profile of updates %d-%d: %s not written (%s); training goes on without it",
                           *self.window, trace, err.strerror or err)
        if self.memory_snapshot:
            self._dump_memory(f"memory_rank{self.rank}")
        if self.rank == 0:
            sort = "self_cuda_time_total" if self.device_type == "cuda" else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=sort, row_limit=TOP_OPERATORS)
            logger.info("profile of updates %d-%d: one trace per rank in %s (chrome://tracing, ui.perfetto.dev); "
                        "top operators by self time:\n%s", *self.window, self.directory, table)

    def _dump_memory(self, name: str) -> Path | None:
        """The allocator's history in ``name``.pickle; None (and a warning) if it cannot be written."""
        path = self.directory / f"{name}.pickle"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except OSError as err:
            logger.warning("memory snapshot %s not written (%s)", path, err.strerror or err)
            return None
        return path
