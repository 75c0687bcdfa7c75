"""``--precompile`` and the first compiled update's report: how long compiling took and how many
graphs came from the compile cache."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("distlm")


class CompileReport:
    """Times the first update (where compiling happens) and counts the graphs compiled.

    Inductor's FX graph cache counts its hits and misses, so the line says how many graphs
    came from the cache. The neuron and openxla backends keep caches of their own that
    torch cannot see into: the line gives the graphs dynamo captured and says so.
    """

    def __init__(self, backend: str) -> None:
        # Imported here: torch._dynamo costs every process about a second of start-up, and
        # only a compiled run reads its counters.
        from torch._dynamo.utils import counters

        self._counters = counters
        self.backend = backend
        self.started = time.perf_counter()
        self.before = dict(counters["inductor"])
        self.graphs_before = counters["stats"]["unique_graphs"]

    def log(self) -> str:
        seconds = time.perf_counter() - self.started
        if self.backend == "inductor":
            now = self._counters["inductor"]
            hits = now.get("fxgraph_cache_hit", 0) - self.before.get("fxgraph_cache_hit", 0)
            misses = now.get("fxgraph_cache_miss", 0) - self.before.get("fxgraph_cache_miss", 0)
            outcome = f"{misses} graphs compiled, {hits} taken from the compile cache"
        else:
            graphs = self._counters["stats"]["unique_graphs"] - self.graphs_before
            outcome = (f"{graphs} graphs captured for the {self.backend} backend, whose own cache "
                       "reports its hits in the compiler's log")
        line = f"first update with compilation took {seconds:.1f} s: {outcome}"
        logger.info(line)
        return line


def precompile(trainer) -> str:
    """Run every graph a run needs once, so the compile cache holds them all: the training
    update (double buffering's first update is another), and one validation batch. The
    trainer's state changes but is never saved. Returns the log line."""
    report = CompileReport(trainer.ctx.backend.compile_backend)
    batches = trainer.update_batches()
    for _ in range(2 if trainer.config.distributed.double_buffering else 1):
        with trainer.ctx.naming_failed_collectives(trainer.progress.num_updates + 1):
            trainer.train_step(next(batches))
    if trainer.validator.enabled:
        trainer.validator.validate(trainer.model, max_batches=1)
    return report.log()
