"""Named architectures (``--arch``) and the one function that builds them."""

from __future__ import annotations

import dataclasses
import types
import typing

from torch import nn

from distlm.choices import ARCH_FAMILIES
from distlm.errors import UsageError
from distlm.models.llama import LlamaCausalLM, LlamaConfig
from distlm.models.moe import MoECausalLM, MoEConfig
from distlm.models.roberta import RobertaConfig, RobertaMaskedLM

_LLAMA3_8B = LlamaConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    multiple_of=1024,
    ffn_dim_multiplier=1.3,
    rope_theta=500000.0,
    max_seq_len=8192,
    vocab_size=128256,
)

# arch name -> config; its family (hence model class) is in choices.ARCH_FAMILIES. A published
# arch carries its published vocabulary size, so it builds with no data; the tiny ones leave
# vocab_size at 0: it comes from the data at build time. Every build may override both
# (build_model's arguments).
_CONFIGS: dict[str, RobertaConfig | LlamaConfig | MoEConfig] = {
    # Small enough (~1.8M parameters without the embedding) to train on one CPU core.
    "roberta_tiny": RobertaConfig(dim=192, n_layers=4, n_heads=4, ffn_dim=768, max_positions=512),
    # fairseq's roberta.base / Hugging Face's roberta-base (GPT-2 BPE, 50265 symbols).
    "roberta_base": RobertaConfig(dim=768, n_layers=12, n_heads=12, ffn_dim=3072, max_positions=512,
                                  vocab_size=50265),
    "roberta_large": RobertaConfig(dim=1024, n_layers=24, n_heads=16, ffn_dim=4096, max_positions=512,
                                   vocab_size=50265),
    "llama_tiny": LlamaConfig(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, multiple_of=64, max_seq_len=2048),
    # The feed-forward sizes come from Meta's params.json (multiple_of, ffn_dim_multiplier):
    # 11008 for Llama 2 7B and 14336 for Llama 3 8B, Hugging Face's intermediate_size.
    "llama2_7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, multiple_of=256, max_seq_len=4096,
                             vocab_size=32000),
    "llama3_8b": _LLAMA3_8B,
    # Llama 3 8B's weights layout with the 128K context of Llama 3.1 (llama3 rope scaling).
    "llama3_1_8b": dataclasses.replace(
        _LLAMA3_8B,
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=8192,
        max_seq_len=131072,
    ),
    # Mixture of experts: Qwen3-MoE's layout (query/key norms), 8 experts of which each token
    # uses 2, every layer; small enough for a CPU core.
    "qwen3_moe_tiny": MoEConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, n_experts=8, top_k=2,
                                moe_ffn_dim=32, qk_norm=True, max_seq_len=2048),
    # Shapes of the published models, from their config.json (Hugging Face's names in brackets):
    # the experts' hidden size (moe_intermediate_size; Mixtral's intermediate_size), the
    # router's aux-loss coefficient (router_aux_loss_coef).
    "mixtral_8x7b": MoEConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, n_experts=8, top_k=2,
                              moe_ffn_dim=14336, aux_loss_coef=0.02, rope_theta=1e6, max_seq_len=32768,
                              vocab_size=32000),
    "qwen3_moe_30b_a3b": MoEConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_size=128, ffn_dim=6144,
                                   n_experts=128, top_k=8, moe_ffn_dim=768, aux_loss_coef=0.001, qk_norm=True,
                                   norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, vocab_size=151936),
}

# fairseq's own archs: trained from scratch, their learned positions follow
# --tokens-per-sample when --max-positions is not given, as fairseq's masked LM sizes them.
POSITIONS_FROM_SAMPLES = ("roberta_base", "roberta_large")

# Set by build_model's own arguments, so not accepted as overrides.
_BUILD_ARGUMENTS = ("vocab_size", "padding_idx")


def _lookup(arch: str) -> tuple[type[nn.Module], RobertaConfig | LlamaConfig | MoEConfig]:
    if arch not in ARCHS:
        raise UsageError(f"--arch {arch} is unknown; choose one of: {', '.join(ARCHS)}")
    return ARCHS[arch]


FAMILIES: dict[type[nn.Module], str] = {RobertaMaskedLM: "roberta", LlamaCausalLM: "llama",
                                        MoECausalLM: "qwen3_moe"}
"""Model class -> the family name that fairseq's architecture flags and Hugging Face's model_type use:
the one table of model families."""

FAMILY_MODELS: dict[str, type[nn.Module]] = {family: model_class for model_class, family in FAMILIES.items()}
"""Family name -> its model class (what a checkpoint's ``model_config`` builds)."""

if set(_CONFIGS) != set(ARCH_FAMILIES):
    raise RuntimeError(f"distlm.choices.ARCH_FAMILIES and the registry's configs name different archs: "
                       f"{sorted(set(_CONFIGS) ^ set(ARCH_FAMILIES))}")
ARCHS: dict[str, tuple[type[nn.Module], RobertaConfig | LlamaConfig | MoEConfig]] = {
    arch: (FAMILY_MODELS[family], _CONFIGS[arch])
    for arch, family in ARCH_FAMILIES.items()
}
"""Arch name -> (model class, config)."""

FAMILY_CONFIGS: dict[str, type] = {FAMILIES[model_class]: type(config) for model_class, config in ARCHS.values()}
"""Family name -> its config class (what a checkpoint's ``model_config`` is read into)."""


def arch_family(arch: str) -> str:
    """``"roberta"``, ``"llama"`` or ``"qwen3_moe"``."""
    return FAMILIES[_lookup(arch)[0]]


def arch_task(arch: str) -> str:
    """``"masked_lm"`` or ``"causal_lm"``: which objective (and data pipeline) the arch trains."""
    model_class, _ = _lookup(arch)
    return model_class.task


def arch_config(arch: str) -> RobertaConfig | LlamaConfig:
    """The named arch's configuration (a copy), e.g. to check a tp degree before building anything."""
    return dataclasses.replace(_lookup(arch)[1])


def _accepts(annotation: object, value: object) -> bool:
    """Whether ``value`` fits a config field annotated ``int``, ``float`` or ``X | None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def build_model(
    arch: str, vocab_size: int | None = None, padding_idx: int | None = None, **overrides: object
) -> nn.Module:
    """Build ``arch`` on the current default device (use ``with torch.device("meta")``
    for deferred initialisation, then ``to_empty`` and ``init_weights()``).

    ``vocab_size`` and ``padding_idx`` default to the arch's own: a published arch's
    vocabulary, padding id 1. ``overrides`` replace fields of the arch's config, e.g.
    ``dropout=0.0``.
    """
    model_class, base_config = _lookup(arch)
    if vocab_size is None:
        vocab_size = base_config.vocab_size
        if vocab_size <= 0:
            raise UsageError(f"--arch {arch} takes its vocabulary size from the data; pass vocab_size")
    if padding_idx is None:
        padding_idx = base_config.padding_idx
    # get_type_hints resolves the string annotations left by `from __future__ import annotations`.
    field_types = typing.get_type_hints(type(base_config))
    settings = [f.name for f in dataclasses.fields(base_config) if f.name not in _BUILD_ARGUMENTS]
    for name, value in overrides.items():
        if name not in settings:
            raise UsageError(
                f"--arch {arch} has no model setting '{name}'; valid settings: {', '.join(settings)}"
            )
        if not _accepts(field_types[name], value):
            raise UsageError(
                f"model setting {name}={value!r} has the wrong type for --arch {arch}; "
                f"expected {field_types[name]}"
            )
    config = dataclasses.replace(
        base_config, vocab_size=vocab_size, padding_idx=padding_idx, **overrides
    )
    return model_class(config)
