"""The model a run trains: the named ``--arch`` or the user's own, built for its layout.

Under FSDP or tensor parallel the named arch stays on the meta device until parallelism
has cut it into shards; rank 0 then initialises it once on the host and every rank
receives only its own shards (see ``parallel.api.materialise``). Otherwise every rank
initialises the whole model from the same seed, which gives the same weights.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from distlm.config import TrainConfig, arch_overrides
from distlm.errors import UsageError
from distlm.mesh import ParallelDims
from distlm.models import build_model


@dataclass
class ModelBuild:
    model: nn.Module
    """Initialised on the training device, or still on meta when ``whole_model`` is set."""
    whole_model: Callable[[], nn.Module] | None
    """Rank 0's whole initialised copy on the host, to fill the shards of a meta model."""
    name: str
    """``--arch`` name or the user's model class, as checkpoints record it."""
    uses_masked_tokens: bool
    """A masked LM whose forward takes ``masked_tokens`` computes logits at masked positions only."""


def build_model_for_run(
    config: TrainConfig,
    vocab_size: int,
    padding_idx: int,
    dims: ParallelDims,
    device: torch.device,
    param_dtype: torch.dtype,
    user_model: nn.Module | None = None,
) -> ModelBuild:
    if user_model is not None:
        model = _on_device(user_model, device, param_dtype, config.seed) if _is_meta(user_model) else user_model
        return ModelBuild(model.to(device=device, dtype=param_dtype), None, type(user_model).__name__,
                          _takes_masked_tokens(user_model))
    arch = config.model.arch

    def new_model() -> nn.Module:
        with torch.device("meta"):
            return build_model(arch, vocab_size=vocab_size, padding_idx=padding_idx, **arch_overrides(config.model))

    model = new_model()
    masked_tokens = _takes_masked_tokens(model)
    sharded = (dims.strategy == "fsdp" and dims.dp_enabled) or dims.tp_enabled
    if sharded:
        def whole_model() -> nn.Module:
            return _on_device(new_model(), torch.device("cpu"), param_dtype, config.seed)

        return ModelBuild(model.to(dtype=param_dtype), whole_model, arch, masked_tokens)
    return ModelBuild(_on_device(model, device, param_dtype, config.seed), None, arch, masked_tokens)


def _on_device(model: nn.Module, device: torch.device, param_dtype: torch.dtype, seed: int) -> nn.Module:
    """Materialise a meta model whole on ``device`` and initialise it from the seed."""
    model.to_empty(device=device)
    torch.manual_seed(seed)  # identical initial weights on every rank, and in one process
    with torch.no_grad():
        model.init_weights()
    return model.to(dtype=param_dtype)


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _takes_masked_tokens(model: nn.Module) -> bool:
    return getattr(model, "task", None) == "masked_lm" and "masked_tokens" in inspect.signature(model.forward).parameters


def check_vocabulary(model_vocab: int, data_vocab: int, name: str) -> None:
    """The data's dictionary must fit the model's embedding; extra rows are padding."""
    if data_vocab > model_vocab:
        raise UsageError(
            f"the data's dictionary has {data_vocab} symbols but {name} has a vocabulary of {model_vocab}; "
            "use data tokenized for this model, or an arch sized from the data"
        )
