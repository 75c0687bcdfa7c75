"""Hugging Face in and out: ``config.json`` <-> distlm model configs, and weights converted
tensor by tensor, so an 8B model streams with one tensor in memory and a rank can load
only the tensors (or rows) it holds.

One ``HFAdapter`` per model (``hf/common.py``), the single place where its mapping details
live, in its family's folder: ``llama/hf.py`` (LlamaForCausalLM), ``roberta/hf.py``
(RobertaForMaskedLM) and ``moe/hf.py`` (Qwen3MoeForCausalLM, MixtralForCausalLM); the families'
records (``distlm.models.registry``) list them.

Names are the single-device model's (``model.state_dict()`` keys of an unwrapped model).
``load_hf_model`` and ``write_hf_directory`` below put the pieces together; ``io`` reads
and writes the directory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from distlm.errors import UsageError
from distlm.models import registry
from distlm.models.hf import io
from distlm.models.hf.common import Fetch, HFAdapter, Region, SpecialTokens, refuse

logger = logging.getLogger("distlm")

ADAPTERS: dict[str, HFAdapter] = {
    adapter.model_type: adapter for family in registry.families().values() for adapter in family.hf_adapters
}

__all__ = [
    "ADAPTERS",
    "HFAdapter",
    "SpecialTokens",
    "adapter_for",
    "adapter_for_hf",
    "config_from_hf",
    "config_to_hf",
    "hf_tensor_specs",
    "load_hf_model",
    "save_hf_model",
    "tensor_loader",
    "write_hf_directory",
]


def adapter_for_hf(hf_config: dict[str, Any]) -> HFAdapter:
    """The adapter for a ``config.json``'s ``model_type``."""
    model_type = hf_config.get("model_type")
    if model_type not in ADAPTERS:
        supported = ", ".join(f"{name} ({adapter.architecture})" for name, adapter in ADAPTERS.items())
        raise refuse("model_type", model_type, f"distlm converts only {supported}")
    return ADAPTERS[model_type]


def adapter_for(config: object) -> HFAdapter:
    """The adapter for a distlm model config."""
    for adapter in ADAPTERS.values():
        # The exact class: a mixture of experts' config is a LlamaConfig too, and Llama's
        # layout would drop its experts.
        if type(config) is adapter.config_class and adapter.holds(config):
            return adapter
    raise UsageError(f"a {type(config).__name__} has no Hugging Face adapter; distlm exports Llama, RoBERTa and "
                     "mixture-of-experts (Qwen3-MoE, Mixtral) models")


def config_from_hf(hf_config: dict[str, Any]) -> tuple[type[nn.Module], Any, SpecialTokens]:
    """(distlm model class, its config, the special token ids) of a Hugging Face ``config.json``."""
    adapter = adapter_for_hf(hf_config)
    config, tokens = adapter.config_from_hf(hf_config)
    return adapter.model_class, config, tokens


def config_to_hf(config: Any, tokens: SpecialTokens, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` dict of a distlm model config."""
    return adapter_for(config).config_to_hf(config, tokens, dtype)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_meta else torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def hf_tensor_specs(config: Any, distlm_tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[io.TensorSpec, str]]:
    """Hugging Face name -> (its spec, the distlm tensor it is made from), in export order.

    ``distlm_tensors``: name -> tensor of the single-device model; meta tensors suffice.
    """
    adapter = adapter_for(config)
    specs: dict[str, tuple[io.TensorSpec, str]] = {}
    for name, tensor in distlm_tensors.items():
        for hf_name, hf_tensor in adapter.to_hf(config, name, _meta(tensor)):
            specs[hf_name] = (io.TensorSpec.of(hf_name, hf_tensor), name)
    return specs


def load_hf_model(
    directory: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[nn.Module, SpecialTokens]:
    """The distlm model of a Hugging Face model directory, and its special token ids.

    The model is built on the meta device and materialised once; each parameter is then
    filled from the safetensors files, one tensor at a time. Hugging Face tensors the
    model does not use (a pooler, a tied ``lm_head.weight``) are listed in an info log.
    """
    directory = Path(directory)
    hf_config = io.read_config(directory)
    adapter = adapter_for_hf(hf_config)
    config, tokens = adapter.config_from_hf(hf_config)
    with torch.device("meta"):
        model = adapter.model_class(config)
    model.to_empty(device=device)
    model.to(dtype=dtype)
    used: set[str] = set()
    with io.SafetensorsWeights(directory) as weights:
        load = tensor_loader(directory, config, weights, used)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(load(name))
        unused = sorted(set(weights) - used)
    model.init_buffers()
    if unused:
        logger.info("%s: %d tensors unused by distlm's %s: %s", directory, len(unused), adapter.model_class.__name__,
                    ", ".join(unused))
    return model, tokens


def tensor_loader(
    directory: str | Path, config: Any, weights: io.SafetensorsWeights, used: set[str] | None = None
) -> Callable[[str, Region | None], torch.Tensor]:
    """``load(name, region=None)``: distlm tensor ``name`` of a ``config`` model, or only its
    ``region`` (a rank's shard, one slice per dimension), read from the open ``weights`` of
    ``directory``. A region reads little more than itself from disk (see each adapter's
    ``from_hf``).

    Each Hugging Face tensor's shape is checked against the one ``config`` implies before
    any of it is read; a tensor missing or misshapen is a UsageError naming it. ``used``
    collects the Hugging Face names read.
    """
    directory = Path(directory)
    adapter = adapter_for(config)
    with torch.device("meta"):
        shapes_of = adapter.model_class(config).state_dict()
    expected = {hf_name: spec.shape for hf_name, (spec, _) in hf_tensor_specs(config, shapes_of).items()}

    def read(hf_name: str, region: Region | None) -> torch.Tensor:
        shape = tuple(weights.get_slice(hf_name).get_shape())  # the header only; KeyError when absent
        if hf_name in expected and shape != expected[hf_name]:
            raise UsageError(
                f"{directory}: tensor {hf_name} has shape {list(shape)}, but config.json implies {list(expected[hf_name])}"
            )
        if used is not None:
            used.add(hf_name)
        return weights.read(hf_name, region)

    def load(name: str, region: Region | None = None) -> torch.Tensor:
        try:
            return adapter.from_hf(config, name, read, region)
        except KeyError as missing:
            raise UsageError(
                f"{directory}: no tensor {missing.args[0]} (distlm's {name} is made from it); "
                f"the weights are not those of the {adapter.architecture} config.json describes"
            ) from None

    return load


def write_hf_directory(
    directory: str | Path,
    config: Any,
    distlm_tensors: Mapping[str, torch.Tensor],
    fetch: Fetch,
    tokens: SpecialTokens,
    *,
    max_shard_size: int | str = io.DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
    """Write a Hugging Face model directory: weights, ``config.json`` and, for a causal LM,
    ``generation_config.json``; returns the files written. Tokenizer files are the caller's.

    ``distlm_tensors``: name -> tensor of the single-device model, only read for names,
    shapes and dtypes (meta tensors suffice). ``fetch(name)`` returns the real distlm
    tensor; it is called once, just before the first Hugging Face tensor made from it is
    written, so one distlm tensor at a time need be in memory (e.g. read from a checkpoint).
    """
    directory = Path(directory)
    adapter = adapter_for(config)
    specs = hf_tensor_specs(config, distlm_tensors)
    if not specs:
        raise ValueError("no tensors to write")

    # The pieces of the last distlm tensor fetched: a mixture of experts' stacked experts make
    # one file tensor per expert, written one after another, and are fetched once for all.
    made: dict[str, dict[str, torch.Tensor]] = {}

    def fetch_hf(hf_name: str) -> torch.Tensor:
        source = specs[hf_name][1]
        if source not in made:
            made.clear()
            made[source] = dict(adapter.to_hf(config, source, fetch(source)))
        return made[source][hf_name]

    paths = io.write_safetensors(directory, [spec for spec, _ in specs.values()], fetch_hf, max_shard_size)
    dtype = next(iter(specs.values()))[0].dtype
    paths.append(io.write_json(directory, io.CONFIG_NAME, adapter.config_to_hf(config, tokens, dtype)))
    generation = adapter.generation_config(tokens)
    if generation is not None:
        paths.append(io.write_json(directory, io.GENERATION_CONFIG_NAME, generation))
    return paths


def save_hf_model(
    model: nn.Module,
    directory: str | Path,
    tokens: SpecialTokens,
    *,
    max_shard_size: int | str = io.DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
    """Write a single-device distlm model as a Hugging Face model directory (see write_hf_directory)."""
    state = model.state_dict()
    return write_hf_directory(directory, model.config, state, state.__getitem__, tokens, max_shard_size=max_shard_size)
