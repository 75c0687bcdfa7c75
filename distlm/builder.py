"""The model a run trains: a named ``--arch``, a Hugging Face model, or the user's own.

``resolve_model_spec`` turns the model settings into a class and config before anything
is allocated; ``build_model_for_run`` builds it for the layout. Under FSDP or tensor
parallel the model stays on the meta device until parallelism has cut it into shards:
rank 0 then initialises it once on the host and every rank receives only its own
shards (``parallel.api.materialise``), or, from a Hugging Face directory, every rank
fills its own shards one tensor at a time. Otherwise every rank builds the whole model
the same way (same seed, or the same files).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from distlm.config import ModelConfig, arch_overrides
from distlm.errors import UsageError
from distlm.mesh import ParallelDims
from distlm.models import ARCHS
from distlm.models.hf import SpecialTokens, adapter_for_hf, io
from distlm.models.registry import FAMILIES
from distlm.parallel.names import single_device_name

# Settings that set sizes: --init-from-hf takes them from config.json, so they must agree.
_SIZE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_size", "tie_word_embeddings")


@dataclass(frozen=True)
class ModelSpec:
    """What the run trains, before any tensor exists."""

    name: str
    """``--arch`` name, or ``hf_<model_type>`` for a Hugging Face model given without --arch."""
    model_class: type[nn.Module]
    config: Any
    """The model's config; ``vocab_size`` 0 means "from the data"."""
    hf_dir: Path | None = None
    hf_tokens: SpecialTokens | None = None

    @property
    def task(self) -> str:
        return self.model_class.task

    @property
    def family(self) -> str:
        return FAMILIES[self.model_class]

    def build(self, data_vocab_size: int, padding_idx: int) -> nn.Module:
        """The model on the meta device, sized for a dictionary of ``data_vocab_size`` symbols.

        A model with a vocabulary of its own (a published arch, a Hugging Face model) may
        train on a smaller dictionary: the extra rows are padding, as Megatron pads its
        vocabulary. A larger dictionary does not fit.
        """
        vocab = self.config.vocab_size or data_vocab_size
        if data_vocab_size > vocab:
            raise UsageError(
                f"the data's dictionary has {data_vocab_size} symbols but {self.name} has a vocabulary of "
                f"{vocab}; use data tokenized for this model, or an arch sized from the data"
            )
        # A Hugging Face model keeps its own padding id; a named arch pads with the data's.
        padding = self.config.padding_idx if self.hf_dir is not None else padding_idx
        with torch.device("meta"):
            return self.model_class(dataclasses.replace(self.config, vocab_size=vocab, padding_idx=padding))


def resolve_model_spec(settings: ModelConfig) -> ModelSpec:
    """The model of ``--arch`` (with fairseq's size flags) or of ``--init-from-hf``."""
    if settings.init_from_hf is None:
        if settings.arch not in ARCHS:
            raise UsageError(f"--arch {settings.arch} is unknown; choose one of: {', '.join(ARCHS)}")
        model_class, base = ARCHS[settings.arch]
        overrides = arch_overrides(settings, FAMILIES[model_class])
        return ModelSpec(settings.arch, model_class, _replace(base, overrides, f"--arch {settings.arch}"))
    directory = Path(settings.init_from_hf)
    if not (directory / io.CONFIG_NAME).is_file():
        raise UsageError(f"--init-from-hf {directory}: no {io.CONFIG_NAME} there; name a Hugging Face model directory")
    adapter = adapter_for_hf(io.read_config(directory))
    config, tokens = adapter.config_from_hf(io.read_config(directory))
    family = FAMILIES[adapter.MODEL_CLASS]
    overrides = arch_overrides(settings, family)
    sized = sorted(set(overrides) & set(_SIZE_FIELDS + ("max_positions", "max_seq_len")))
    if sized:
        raise UsageError(
            f"--init-from-hf takes the model's sizes from {directory / io.CONFIG_NAME}; drop the flags that "
            f"set {', '.join(sized)}"
        )
    config = _replace(config, overrides, f"--init-from-hf {directory}")
    if settings.arch is not None:
        _check_arch_agrees(settings.arch, adapter.MODEL_CLASS, config, directory)
    return ModelSpec(settings.arch or f"hf_{family}", adapter.MODEL_CLASS, config, directory, tokens)


def _replace(config: Any, overrides: dict[str, Any], what: str) -> Any:
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise UsageError(f"{what} has no model setting {unknown[0]}")
    return dataclasses.replace(config, **overrides)


def _check_arch_agrees(arch: str, model_class: type, config: Any, directory: Path) -> None:
    if arch not in ARCHS:
        raise UsageError(f"--arch {arch} is unknown; choose one of: {', '.join(ARCHS)}")
    arch_class, arch_config = ARCHS[arch]
    if arch_class is not model_class:
        raise UsageError(
            f"--arch {arch} is a {FAMILIES[arch_class]} model but --init-from-hf {directory} holds a "
            f"{FAMILIES[model_class]} model; drop --arch or make them agree"
        )
    for name in _SIZE_FIELDS + ("vocab_size",):
        mine, theirs = getattr(arch_config, name, None), getattr(config, name, None)
        if name == "vocab_size" and not mine:
            continue
        if mine != theirs:
            raise UsageError(
                f"--arch {arch} has {name}={mine} but --init-from-hf {directory} has {name}={theirs}; "
                "drop --arch or make them agree"
            )


@dataclass
class ModelBuild:
    model: nn.Module
    """Initialised on the training device, or still on meta when one of the fillers below is set."""
    name: str
    """What checkpoints record as the arch: ``--arch``, ``hf_<model_type>`` or the user's model class."""
    uses_masked_tokens: bool
    """A masked LM whose forward takes ``masked_tokens`` computes logits at masked positions only."""
    whole_model: Callable[[], nn.Module] | None = None
    """Rank 0's whole initialised copy on the host, to fill the shards of a meta model."""
    fill_shards: Callable[[nn.Module], None] | None = None
    """Fills a parallelised meta model's shards in place, each rank its own (Hugging Face weights)."""


def build_model_for_run(
    spec: ModelSpec | None,
    vocab_size: int,
    padding_idx: int,
    dims: ParallelDims,
    device: torch.device,
    param_dtype: torch.dtype,
    seed: int,
    user_model: nn.Module | None = None,
    load_hf_weights: bool = True,
) -> ModelBuild:
    """``load_hf_weights=False`` (a resumed run) builds a Hugging Face model without reading its weights."""
    if user_model is not None:
        model = _initialised(user_model, device, param_dtype, seed) if _is_meta(user_model) else user_model
        return ModelBuild(model.to(device=device, dtype=param_dtype), type(user_model).__name__,
                          _takes_masked_tokens(user_model))
    model = spec.build(vocab_size, padding_idx)
    masked_tokens = _takes_masked_tokens(model)
    sharded = (dims.strategy == "fsdp" and dims.dp_enabled) or dims.tp_enabled
    from_hf = spec.hf_dir is not None and load_hf_weights
    if not sharded:
        model = _from_hf(model, spec, device, param_dtype) if from_hf else _initialised(model, device, param_dtype, seed)
        return ModelBuild(model, spec.name, masked_tokens)
    model = model.to(dtype=param_dtype)  # still meta: no memory yet
    if from_hf:
        return ModelBuild(model, spec.name, masked_tokens,
                          fill_shards=lambda parallel: _fill_shards_from_hf(parallel, spec, device))

    def whole_model() -> nn.Module:
        return _initialised(spec.build(vocab_size, padding_idx), torch.device("cpu"), param_dtype, seed)

    return ModelBuild(model, spec.name, masked_tokens, whole_model=whole_model)


def _initialised(model: nn.Module, device: torch.device, param_dtype: torch.dtype, seed: int) -> nn.Module:
    """Materialise a meta model whole on ``device`` and initialise it from the seed."""
    model.to_empty(device=device)
    torch.manual_seed(seed)  # identical initial weights on every rank, and in one process
    with torch.no_grad():
        model.init_weights()
    return model.to(dtype=param_dtype)


def _from_hf(model: nn.Module, spec: ModelSpec, device: torch.device, param_dtype: torch.dtype) -> nn.Module:
    model.to_empty(device=device)
    _fill_shards_from_hf(model, spec, device)
    return model.to(dtype=param_dtype)


@torch.no_grad()
def _fill_shards_from_hf(model: nn.Module, spec: ModelSpec, device: torch.device) -> None:
    """Each parameter's local shard from the Hugging Face files, one whole tensor at a time.

    A rank never holds more than its own shards plus the one tensor being converted
    (the q/k permutation and RoBERTa's folded token types need the whole tensor).
    Vocabulary rows beyond the data's dictionary are the model's own, as published.
    """
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    adapter = adapter_for_hf(io.read_config(spec.hf_dir))
    config = spec.config
    with io.SafetensorsWeights(spec.hf_dir) as weights:
        fetch = _checked_fetch(weights, spec.hf_dir)
        for name, param in model.named_parameters():
            whole = adapter.import_tensor(config, single_device_name(name), fetch)
            if isinstance(param, DTensor):
                local = distribute_tensor(whole.to(device), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(whole)
    model.init_buffers()  # derived from the config (rotary tables), never saved


def _checked_fetch(weights: Any, directory: Path) -> Callable[[str], torch.Tensor]:
    def fetch(hf_name: str) -> torch.Tensor:
        try:
            return weights[hf_name]
        except KeyError:
            raise UsageError(f"--init-from-hf {directory}: no tensor {hf_name} in the safetensors files") from None

    return fetch


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _takes_masked_tokens(model: nn.Module) -> bool:
    return getattr(model, "task", None) == "masked_lm" and "masked_tokens" in inspect.signature(model.forward).parameters
