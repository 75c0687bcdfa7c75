"""``--compile``: each transformer block compiled on its own, as torchtitan does.

All blocks of a model share one graph (same code, same shapes), so the compiler runs
once per distinct graph, not once per layer, and the result composes with what is
applied around the blocks: tensor parallel inside them, activation checkpointing
around them (outside the compiled region: inside it, torch 2.13 cannot save a tensor
parallel block's DeviceMesh for backward), FSDP and DDP outside. ``Module.compile`` compiles in place, so parameter
names, checkpoints and exports stay those of the single-device model.

``--compile-cache DIR`` points the compiler's artefact cache at a directory that other
nodes and the next run share; the first update reports how long compiling took and
how many graphs came from the cache.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping

from torch import nn

from distlm.errors import UsageError
from distlm.models.contract import model_blocks

logger = logging.getLogger("distlm")


def apply_compile(model: nn.Module, backend: str) -> None:
    """Compile every block of ``model`` in place with ``backend`` (inductor, neuron, openxla)."""
    blocks = model_blocks(model)
    if blocks is None:
        raise UsageError(
            f"--compile compiles each of the model's blocks, and {type(model).__name__} declares no blocks "
            "(an nn.ModuleList); drop --compile or declare them"
        )
    for block in blocks:
        block.compile(backend=backend)
    logger.info("compiling %d blocks with the %s backend (one graph shared by all)", len(blocks), backend)


def use_compile_cache(directory: str, variables: Mapping[str, str]) -> None:
    """Point the compiler caches at ``directory`` through the backend's ``variables``
    (variable -> sub-directory). The flag wins over a variable already set: torch sets
    ``TORCHINDUCTOR_CACHE_DIR`` to its default itself the first time it asks."""
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--compile-cache {directory} cannot be created ({err.strerror or err})") from None
    for variable, sub in variables.items():
        os.environ[variable] = str(root / sub)


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
