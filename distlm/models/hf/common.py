"""What the per-model adapters share: the adapter type, special token ids, the tensor-fetch
and part-read signatures, and one-line refusals of Hugging Face settings distlm cannot represent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from distlm.errors import UsageError

Fetch = Callable[[str], torch.Tensor]
"""Returns the tensor of the given name; raises KeyError when there is none."""

Region = tuple[slice, ...]
"""Part of a tensor: one slice per dimension, with explicit start and stop (a rank's shard)."""

Read = Callable[[str, Region | None], torch.Tensor]
"""``read(hf_name, region)`` returns ``tensor[region]`` of the Hugging Face tensor of that
name, reading only that part from disk (the whole tensor for ``None``); raises KeyError
when there is none."""


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids that Hugging Face keeps in ``config.json`` and ``generation_config.json``.

    distlm's models do not hold them (a dictionary or tokenizer does), so they travel
    next to the model config: read on import, written back on export.
    """

    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], defaults: dict[str, Any]) -> SpecialTokens:
        """The ids of a ``config.json``, with transformers' defaults for absent keys."""
        names = ("bos_token_id", "eos_token_id", "pad_token_id")
        return cls(**{name: setting(hf_config, defaults, name) for name in names})

    def to_hf(self) -> dict[str, Any]:
        return {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}


def refuse(key: str, value: Any, why: str) -> UsageError:
    """The one-line error for a ``config.json`` setting distlm cannot represent."""
    return UsageError(f"config.json {key}={value!r}: {why}")


def setting(hf_config: dict[str, Any], defaults: dict[str, Any], key: str) -> Any:
    """``hf_config[key]``, or transformers' default when the file omits it (as transformers
    reads the same file). A key with neither is refused by name."""
    if key in hf_config:
        return hf_config[key]
    if key in defaults:
        return defaults[key]
    raise UsageError(f"config.json lacks {key}; it is not a complete Hugging Face config")


def check_architectures(hf_config: dict[str, Any], expected: str) -> None:
    """Refuse a head other than the one distlm's model has (e.g. a sequence classifier)."""
    architectures = hf_config.get("architectures")
    if architectures is not None and list(architectures) != [expected]:
        raise refuse(
            "architectures", architectures,
            f"distlm converts {expected} only for model_type {hf_config.get('model_type')}",
        )


def require(hf_config: dict[str, Any], defaults: dict[str, Any], key: str, allowed: tuple[Any, ...], why: str) -> None:
    """Refuse ``key`` unless its value (or transformers' default) is one of ``allowed``."""
    value = setting(hf_config, defaults, key)
    if value not in allowed:
        raise refuse(key, value, why)


@dataclass(frozen=True)
class HFAdapter:
    """One Hugging Face model type and distlm's model of it: the single place where the
    mapping between the two lives (an instance per model: ``hf/llama.py``, ``hf/roberta.py``, two in ``hf/moe.py``).
    Tensor names are the single-device model's (``state_dict()`` keys of an unwrapped model)."""

    model_type: str
    """``config.json``'s ``model_type``."""
    architecture: str
    """The transformers class the weights are laid out for, e.g. ``LlamaForCausalLM``."""
    model_class: type[nn.Module]
    config_class: type
    config_from_hf: Callable[[dict[str, Any]], tuple[Any, SpecialTokens]]
    """``config.json`` -> (distlm config, SpecialTokens); refuses what distlm cannot represent."""
    config_to_hf: Callable[[Any, SpecialTokens, torch.dtype], dict[str, Any]]
    """(config, tokens, dtype) -> the ``config.json`` dict."""
    generation_config: Callable[[SpecialTokens], dict[str, Any] | None]
    """The ``generation_config.json`` dict, or None (a masked LM has none)."""
    from_hf: Callable[[Any, str, Read, Region | None], torch.Tensor]
    """(config, name, read, region) -> distlm tensor ``name``, or only its ``region`` (a rank's
    shard), reading little more than that."""
    to_hf: Callable[[Any, str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]
    """(config, name, tensor) -> the (Hugging Face name, tensor) pairs made from one distlm tensor."""
    holds: Callable[[Any], bool] = lambda config: True
    """Whether a ``config_class`` config is of this layout (one config class, several layouts:
    a mixture of experts exports as Qwen3-MoE or Mixtral)."""
