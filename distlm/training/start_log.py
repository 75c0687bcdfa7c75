"""What rank 0 says before the first update, which may take minutes: the data, the
model's size, shape and placement, and where training starts."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distlm.errors import UsageError
from distlm.models import registry
from distlm.models.flops import count_parameters
from distlm.state.names import unwrap
from distlm.training.builder import ModelSpec, Vocabulary
from distlm.training.memory import memory_report

logger = logging.getLogger("distlm")


def log_start(is_main: bool, data: Any, model: nn.Module, fresh: ModelSpec | None, seed: int,
              vocabulary: Vocabulary | None = None, stage_sizes: list[int] | None = None) -> None:
    """Rank 0 says what it found before the first update, which may take minutes: the
    data, the model's size and shape and what each rank holds of it, and where it starts
    from (``fresh``: the spec of a run not resumed from a checkpoint). ``stage_sizes``:
    under pipeline parallelism, the parameters of each pipeline rank's stages."""
    if not is_main:
        return
    dictionary = getattr(data, "dictionary", None)
    logger.info("data: %d training samples%s", len(data),
                f", vocabulary of {len(dictionary)} symbols" if dictionary is not None else "")
    for line in getattr(data, "describe_sources", list)():  # a mixture's sources (distlm/data/mixture.py)
        logger.info("data source %s", line)
    held = memory_report(model, None)
    if stage_sizes is None:
        logger.info("model: %s parameters, %.1f MiB of weights on each rank (%s)",
                    f"{_parameter_count(model):,}", held["param_bytes"] / 2**20, "sharded" if _sharded(model) else "whole")
    else:
        logger.info("model: %s parameters, in %d pipeline stages of %s parameters; %.1f MiB of weights on rank 0 (%s)",
                    f"{_whole_count(model, stage_sizes):,}", len(stage_sizes), ", ".join(f"{n:,}" for n in stage_sizes),
                    held["param_bytes"] / 2**20, "sharded" if _sharded(model) else "its stage whole")
    if registry.family_of_model(unwrap(model)) is not None:
        logger.info("model shape: %s", describe_shape(unwrap(model).config, vocabulary))
    if fresh is not None:
        logger.info("starting from %s", f"the weights in --init-from-hf {fresh.hf_dir}"
                    if fresh.hf_dir is not None else f"seed {seed}")


def choose_document_attention(is_main: bool, model: nn.Module, device: Any, dtype: Any) -> None:
    """--document-mask: a model that offers a choice (``use_document_attention``) picks how
    attention keeps packed documents apart on ``device`` computing in ``dtype``; rank 0 says
    which, and on CUDA why not the varlen kernel (no silent fallback)."""
    choose = getattr(unwrap(model), "use_document_attention", None)
    if choose is None:
        return
    line = choose(device, dtype)
    if is_main:
        logger.info("%s", line)


def _parameter_count(model: nn.Module) -> int:
    """Single-device parameter count of a (possibly sharded) model."""
    return sum(p.numel() for p in model.parameters())


def pipeline_stage_sizes(model: nn.Module, dims: Any, device_type: str) -> list[int] | None:
    """The parameters each pipeline rank's stages hold, in pipeline order (collective over
    the pipeline group); None without pipeline parallelism."""
    if not dims.pp_enabled:
        return None
    sizes: list[Any] = [None] * dims.pp
    dist.all_gather_object(sizes, _parameter_count(model), group=dims.pp_group(device_type))
    return sizes


def _whole_count(stage: nn.Module, stage_sizes: list[int]) -> int:
    """The whole model's parameters: from the config every stage keeps (a tied weight once),
    else the stages' sum."""
    try:
        return count_parameters(unwrap(stage))
    except UsageError:
        return sum(stage_sizes)


def _sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def describe_shape(config: Any, vocabulary: Vocabulary | None = None) -> str:
    """Layers, width, heads, KV heads, head size, FFN, vocabulary (and where it came from), then
    the family's own part (positions, tied output, experts): what the command line built."""
    family = registry.family_of_config(config)
    s = family.sizes.shape(config)
    source = f" ({vocabulary.source})" if vocabulary is not None else ""
    return (f"{s.n_layers} layers, width {s.dim}, {s.n_heads} heads, {s.n_kv_heads} KV heads, head size "
            f"{s.head_dim}, FFN {s.ffn_dim}, vocabulary {config.vocab_size:,}{source}, {family.sizes.describe(config)}")
