"""``--compile``: each transformer block compiled on its own, as torchtitan does.

All blocks of a model share one graph (same code, same shapes), so the compiler runs
once per distinct graph, not once per layer, and the result composes with what is
applied around the blocks: tensor parallel inside them, activation checkpointing
around them (outside the compiled region: inside it, torch 2.13 cannot save a tensor
parallel block's DeviceMesh for backward), FSDP and DDP outside. ``Module.compile`` compiles in place, so parameter
names, checkpoints and exports stay those of the single-device model.

``--compile-cache DIR`` points the compiler's artefact cache at a directory that other
nodes and the next run share; the first update reports how long compiling took and
how many graphs came from the cache (distlm/training/precompile.py).
"""

from __future__ import annotations

import logging
import os
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
