"""Out of memory, as one line: what the allocator could not get, what the run needs, what to change.

The allocator's own error (``DefaultCPUAllocator: can't allocate memory``, CUDA's
``OutOfMemoryError``) comes from deep inside torch and names neither the model nor a
remedy. Caught where the model is built and around each update, it becomes a
``UsageError`` with an estimate of the per-rank need: weights and gradients in their dtype
and Adam's two fp32 moments (``training.memory.zero_formula_bytes``) sharded as the strategy
shards them (the planner's rule), plus activations that grow with the micro-batch.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterator

import torch
from torch import nn

from distlm.config import TrainConfig
from distlm.errors import UsageError
from distlm.mesh import ParallelDims
from distlm.precision import MODE_DTYPES, dtype_name
from distlm.training.memory import ZERO_STAGES, zero_formula_bytes

_MARKERS = ("can't allocate memory", "out of memory", "failed to allocate")


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in _MARKERS)


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def requested(err: BaseException) -> str:
    """What the allocator was asked for, in words, from its message where it says."""
    match = re.search(r"allocate (\d+(?:\.\d+)?) ?(bytes|[KMGT]i?B)", str(err))
    if match is None:
        return "the allocator could not get the memory it was asked for"
    amount, unit = match.groups()
    if unit == "bytes":
        return f"the allocator could not get {format_bytes(float(amount))}"
    return f"the allocator could not get {amount} {unit}"


BUILD_REMEDY = "use a smaller model, or shard it over more ranks (--strategy fsdp, --tp-degree)"
STEP_REMEDY = ("lower --batch-size (and raise --update-freq to keep the global batch), add "
               "--activation-checkpointing, or shard the model (--strategy fsdp)")


def describe_state_need(num_params: int, dims: ParallelDims, config: TrainConfig) -> str:
    """The per-rank bytes of weights, gradients and Adam state (the ZeRO paper's formulas) of
    ``num_params`` parameters under the layout ``dims``, in words."""
    precision = config.precision_mode
    need = zero_formula_bytes(max(1, num_params // dims.tp), dims.dp, ZERO_STAGES.get(dims.strategy, 0),
                              precision=precision)["total_bytes"]
    weights = dtype_name(MODE_DTYPES[precision].param)
    return (f"the model's {num_params:,} parameters need about {format_bytes(need)} per rank for {weights} weights, "
            f"gradients and Adam state under --strategy {dims.strategy} (dp {dims.dp} x tp {dims.tp})")


def describe_step_need(model: nn.Module, dims: ParallelDims, config: TrainConfig) -> str:
    """What an update of ``model`` needs per rank, in words: its state, plus the activations."""
    data = config.data
    return (f"{describe_state_need(sum(p.numel() for p in model.parameters()), dims, config)}, plus the activations "
            f"of --batch-size {data.batch_size} x --tokens-per-sample {data.tokens_per_sample} tokens")


@contextlib.contextmanager
def naming_out_of_memory(where: str, need: Callable[[], str], remedy: str) -> Iterator[None]:
    """Turn the allocator's error inside the block into one line: ``where``, what it could
    not get, ``need()`` (computed only then) and ``remedy``."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if not is_out_of_memory(err):
            raise
        raise UsageError(f"out of memory {where}: {requested(err)}; {need()}; {remedy}") from None
