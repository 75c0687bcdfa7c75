"""Hugging Face ``RobertaForMaskedLM`` <-> distlm ``RobertaMaskedLM``: every mapping detail, in one place.

Tensor names (Hugging Face, distlm), ``i`` the layer index, each ``.weight`` and ``.bias``:

==============================================================  ===============================
``roberta.embeddings.word_embeddings.weight``                   ``embed_tokens.weight``
``roberta.embeddings.position_embeddings.weight``               ``embed_positions.weight``
  + row 0 of ``roberta.embeddings.token_type_embeddings.weight``  (folded in, see below)
``roberta.embeddings.LayerNorm``                                ``emb_layer_norm``
``roberta.encoder.layer.i.attention.self.query``                ``layers.i.self_attn.q_proj``
``roberta.encoder.layer.i.attention.self.key``                  ``layers.i.self_attn.k_proj``
``roberta.encoder.layer.i.attention.self.value``                ``layers.i.self_attn.v_proj``
``roberta.encoder.layer.i.attention.output.dense``              ``layers.i.self_attn.out_proj``
``roberta.encoder.layer.i.attention.output.LayerNorm``          ``layers.i.self_attn_layer_norm``
``roberta.encoder.layer.i.intermediate.dense``                  ``layers.i.fc1``
``roberta.encoder.layer.i.output.dense``                        ``layers.i.fc2``
``roberta.encoder.layer.i.output.LayerNorm``                    ``layers.i.final_layer_norm``
``lm_head.dense``, ``lm_head.layer_norm``                       ``lm_head.dense``, ``lm_head.layer_norm``
``lm_head.bias`` (= ``lm_head.decoder.bias``)                   ``lm_head.bias``
``lm_head.decoder.weight`` (= the word embeddings)              (tied: ``embed_tokens.weight``)
==============================================================  ===============================

Positions: both count real tokens from ``padding_idx + 1`` and give padding the position
``padding_idx`` (fairseq's make_positions; transformers'
create_position_ids_from_input_ids), so the tables are the same rows:
max_position_embeddings = max_positions + padding_idx + 1 (514 for roberta-base).

Token types: distlm has none. Hugging Face adds row 0 of ``token_type_embeddings`` to
every token when no token_type_ids are given (RoBERTa's pretraining never gave any), and
embedding sums are linear, so import folds that row into every row of the position
table, and export writes a zero row beside the folded table: transformers then computes
the same sums. A checkpoint with more than one token type (``type_vocab_size`` > 1) is
refused, since distlm could represent only its type-0 behaviour and the export would
not be the same model.

Padding: at real positions the logits equal transformers' when it is given
``attention_mask = input_ids != pad`` (distlm derives that mask itself). At padded
positions they differ by design: distlm zeroes padded embeddings as fairseq does, and
transformers computes them.

Refused: any architecture but RobertaForMaskedLM, ``hidden_act`` other than gelu (exact
erf GELU), ``position_embedding_type`` other than absolute, ``is_decoder`` or
``add_cross_attention``, ``type_vocab_size`` other than 1, ``tie_word_embeddings`` false,
and no ``pad_token_id``.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from distlm.errors import UsageError
from distlm.models.hf.common import (
    HFAdapter,
    Read,
    Region,
    SpecialTokens,
    check_architectures,
    refuse,
    require,
    setting,
)
from distlm.models.roberta.config import RobertaConfig
from distlm.models.roberta.model import RobertaMaskedLM

MODEL_TYPE = "roberta"
ARCHITECTURE = "RobertaForMaskedLM"
MODEL_CLASS = RobertaMaskedLM
CONFIG_CLASS = RobertaConfig

# transformers' RobertaConfig defaults (position_embedding_type: 4.x's), used for keys a
# config.json leaves out, as transformers itself does when it reads the file.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50265,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "is_decoder": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
    "position_embedding_type": "absolute",
}

POSITIONS = "roberta.embeddings.position_embeddings.weight"
TOKEN_TYPES = "roberta.embeddings.token_type_embeddings.weight"
LM_HEAD_BIAS = "lm_head.bias"
# transformers ties it to lm_head.bias; older checkpoints may carry only this name.
DECODER_BIAS = "lm_head.decoder.bias"

_TOP_LEVEL_NAMES = {
    "embed_tokens.weight": "roberta.embeddings.word_embeddings.weight",
    "embed_positions.weight": POSITIONS,
    "emb_layer_norm.weight": "roberta.embeddings.LayerNorm.weight",
    "emb_layer_norm.bias": "roberta.embeddings.LayerNorm.bias",
    "lm_head.dense.weight": "lm_head.dense.weight",
    "lm_head.dense.bias": "lm_head.dense.bias",
    "lm_head.layer_norm.weight": "lm_head.layer_norm.weight",
    "lm_head.layer_norm.bias": "lm_head.layer_norm.bias",
    "lm_head.bias": LM_HEAD_BIAS,
}
_LAYER_MODULES = {
    "self_attn.q_proj": "attention.self.query",
    "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value",
    "self_attn.out_proj": "attention.output.dense",
    "self_attn_layer_norm": "attention.output.LayerNorm",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
    "final_layer_norm": "output.LayerNorm",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")


# ------------------------------------------------------------------------ config


def config_from_hf(hf_config: dict[str, Any]) -> tuple[RobertaConfig, SpecialTokens]:
    """distlm's config (and the special token ids) of a Hugging Face RoBERTa ``config.json``."""
    if hf_config.get("model_type") != MODEL_TYPE:
        raise refuse("model_type", hf_config.get("model_type"), f"expected {MODEL_TYPE}")
    check_architectures(hf_config, ARCHITECTURE)
    require(
        hf_config, DEFAULTS, "hidden_act", ("gelu",), "distlm's RoBERTa uses the exact (erf) GELU, Hugging Face's gelu"
    )
    require(
        hf_config, DEFAULTS, "position_embedding_type", ("absolute",),
        "distlm's RoBERTa has learned absolute positions only",
    )
    require(hf_config, DEFAULTS, "is_decoder", (False,), "distlm's RoBERTa is a bidirectional encoder")
    require(hf_config, DEFAULTS, "add_cross_attention", (False,), "distlm's RoBERTa has no cross-attention")
    require(
        hf_config, DEFAULTS, "type_vocab_size", (1,),
        "distlm's RoBERTa has no token types (one type-0 row is folded into the positions); "
        "only single-type models such as roberta-base convert",
    )
    require(
        hf_config, DEFAULTS, "tie_word_embeddings", (True,),
        "distlm's RoBERTa LM head projects onto the token embedding itself",
    )
    padding_idx = setting(hf_config, DEFAULTS, "pad_token_id")
    if not isinstance(padding_idx, int) or padding_idx < 0:
        raise refuse(
            "pad_token_id", padding_idx, "RoBERTa's positions count from pad_token_id + 1; it must be a token id"
        )
    table_rows = setting(hf_config, DEFAULTS, "max_position_embeddings")
    config = RobertaConfig(
        dim=setting(hf_config, DEFAULTS, "hidden_size"),
        n_layers=setting(hf_config, DEFAULTS, "num_hidden_layers"),
        n_heads=setting(hf_config, DEFAULTS, "num_attention_heads"),
        ffn_dim=setting(hf_config, DEFAULTS, "intermediate_size"),
        max_positions=table_rows - padding_idx - 1,
        dropout=float(setting(hf_config, DEFAULTS, "hidden_dropout_prob")),
        attention_dropout=float(setting(hf_config, DEFAULTS, "attention_probs_dropout_prob")),
        layer_norm_eps=float(setting(hf_config, DEFAULTS, "layer_norm_eps")),
        vocab_size=setting(hf_config, DEFAULTS, "vocab_size"),
        padding_idx=padding_idx,
    )
    if config.max_positions <= 0:
        raise refuse(
            "max_position_embeddings", table_rows,
            f"leaves no positions after the padding offset pad_token_id + 1 = {padding_idx + 1}",
        )
    config.validate()
    return config, SpecialTokens.from_hf(hf_config, DEFAULTS)


def config_to_hf(config: RobertaConfig, tokens: SpecialTokens, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``config`` for transformers' RobertaForMaskedLM."""
    if tokens.pad_token_id is not None and tokens.pad_token_id != config.padding_idx:
        raise UsageError(
            f"pad_token_id={tokens.pad_token_id} differs from the model's padding_idx={config.padding_idx}, "
            "which RoBERTa's positions depend on; export with the model's padding id"
        )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "intermediate_size": config.ffn_dim,
        "hidden_act": "gelu",
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_positions + config.padding_idx + 1,
        "type_vocab_size": 1,
        "layer_norm_eps": config.layer_norm_eps,
        "position_embedding_type": "absolute",
        "is_decoder": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": tokens.bos_token_id,
        "eos_token_id": tokens.eos_token_id,
        "pad_token_id": config.padding_idx,
        "dtype": str(dtype).removeprefix("torch."),
    }


def generation_config(tokens: SpecialTokens) -> None:
    """A masked LM generates nothing: no ``generation_config.json``."""
    return None


# ----------------------------------------------------------------------- tensors


def hf_name(name: str) -> str:
    """The Hugging Face name of distlm tensor ``name`` (for embed_positions, the position table)."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_MODULES:
        raise ValueError(f"distlm RoBERTa tensor {name!r} has no Hugging Face counterpart")
    index, module, kind = match.groups()
    return f"roberta.encoder.layer.{index}.{_LAYER_MODULES[module]}.{kind}"


def import_part(config: RobertaConfig, name: str, read: Read, region: Region | None = None) -> torch.Tensor:
    """``region`` of distlm tensor ``name`` (all of it for None), read from the Hugging Face files.

    Each tensor reads only the region of its source: the position table's rows and
    columns plus the same columns of the one token-type row folded into every row.
    """
    if name == "embed_positions.weight":
        type_zero = (slice(0, 1), slice(None) if region is None else region[1])
        return read(POSITIONS, region) + read(TOKEN_TYPES, type_zero)[0]
    if name == "lm_head.bias":
        try:
            return read(LM_HEAD_BIAS, region)
        except KeyError:
            return read(DECODER_BIAS, region)
    return read(hf_name(name), region)


def export_tensors(config: RobertaConfig, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face (name, tensor) pairs made from distlm tensor ``name``: the position
    table also yields the zero token-type row its type-0 row was folded from.

    Shape-only work, so meta tensors give the names and shapes without any data.
    """
    yield hf_name(name), tensor
    if name == "embed_positions.weight":
        yield TOKEN_TYPES, torch.zeros(1, tensor.shape[1], dtype=tensor.dtype, device=tensor.device)


ADAPTER = HFAdapter(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, model_class=MODEL_CLASS, config_class=CONFIG_CLASS,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, generation_config=generation_config,
    from_hf=import_part, to_hf=export_tensors,
)
