"""Hugging Face ``LlamaForCausalLM`` <-> distlm ``LlamaCausalLM``: every mapping detail, in one place.

Tensor names (Hugging Face, distlm), ``i`` the layer index:

=================================================  ===============================
``model.embed_tokens.weight``                      ``tok_embeddings.weight``
``model.layers.i.input_layernorm.weight``          ``layers.i.attention_norm.weight``
``model.layers.i.self_attn.q_proj.weight``         ``layers.i.attention.wq.weight`` (rows permuted)
``model.layers.i.self_attn.k_proj.weight``         ``layers.i.attention.wk.weight`` (rows permuted)
``model.layers.i.self_attn.v_proj.weight``         ``layers.i.attention.wv.weight``
``model.layers.i.self_attn.o_proj.weight``         ``layers.i.attention.wo.weight``
``model.layers.i.post_attention_layernorm.weight`` ``layers.i.ffn_norm.weight``
``model.layers.i.mlp.gate_proj.weight``            ``layers.i.feed_forward.w1.weight``
``model.layers.i.mlp.up_proj.weight``              ``layers.i.feed_forward.w3.weight``
``model.layers.i.mlp.down_proj.weight``            ``layers.i.feed_forward.w2.weight``
``model.norm.weight``                              ``norm.weight``
``lm_head.weight``                                 ``output.weight``
=================================================  ===============================

With ``tie_word_embeddings`` distlm has no ``output.weight`` (the output projection is
``tok_embeddings.weight``) and none is written: transformers ties ``lm_head.weight`` to the
embedding when it loads, and its own ``save_pretrained`` leaves it out too.

Rotary layout: distlm rotates adjacent pairs (x[2j], x[2j+1]) of each head (Meta's
layout); Hugging Face rotates halves (x[j], x[j + head_dim/2]). The two are the same
model once the rows of wq and wk are permuted within each head: row 2j + c of Meta's
head is row c * head_dim/2 + j of Hugging Face's (transformers' own
convert_llama_weights_to_hf does this). wk is permuted per key/value head, so grouped
query attention needs ``n_kv_heads``. The permutation never crosses heads, so a shard
of whole heads (tensor parallel's row split) can be permuted on its own.

Config (``config.json``): hidden_size = dim, intermediate_size = ffn_dim (always explicit
on import), num_attention_heads = n_heads, num_key_value_heads = n_kv_heads, head_dim =
head_size, rms_norm_eps = norm_eps, max_position_embeddings = max_seq_len, rope theta and
scaling as below, tie_word_embeddings, attention_dropout. distlm's residual ``dropout``
has no Hugging Face counterpart and is not exported; on import it is 0.

Rotary settings are read as transformers 5.x reads them: ``rope_scaling`` (4.x, what
published checkpoints carry) wins over ``rope_parameters`` (5.x); the theta is the chosen
dict's ``rope_theta``, else the top-level ``rope_theta``, else 10000. Exports write both
forms, which agree, so 4.x and 5.x transformers (and other readers of the 4.x keys)
build the same model.

Refused: any architecture but LlamaForCausalLM, ``hidden_act`` other than silu,
``attention_bias`` or ``mlp_bias`` true, a rope type other than default and llama3, and
``partial_rotary_factor`` other than 1.
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
from distlm.models.llama.config import LlamaConfig
from distlm.models.llama.model import LlamaCausalLM

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
MODEL_CLASS = LlamaCausalLM
CONFIG_CLASS = LlamaConfig

# transformers' LlamaConfig defaults, used for keys a config.json leaves out (as
# transformers itself does when it reads the file).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
DEFAULT_ROPE_THETA = 10000.0

_TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


# ------------------------------------------------------------------------ config


def _rope_settings(hf_config: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """(the key the rotary settings came from, those settings, their rope type key)."""
    for key in ("rope_scaling", "rope_parameters"):
        if hf_config.get(key):
            parameters = dict(hf_config[key])
            type_key = "rope_type" if "rope_type" in parameters or "type" not in parameters else "type"
            return key, parameters, type_key
    return "rope_parameters", {}, "rope_type"


def config_from_hf(hf_config: dict[str, Any]) -> tuple[LlamaConfig, SpecialTokens]:
    """distlm's config (and the special token ids) of a Hugging Face Llama ``config.json``."""
    if hf_config.get("model_type") != MODEL_TYPE:
        raise refuse("model_type", hf_config.get("model_type"), f"expected {MODEL_TYPE}")
    check_architectures(hf_config, ARCHITECTURE)
    require(hf_config, DEFAULTS, "mlp_bias", (False,), "distlm's Llama feed-forward projections have no bias")
    fields, tokens = llama_fields(hf_config, DEFAULTS, DEFAULT_ROPE_THETA)
    config = LlamaConfig(**fields)
    config.validate()
    return config, tokens


def llama_fields(
    hf_config: dict[str, Any], defaults: dict[str, Any], default_theta: float
) -> tuple[dict[str, Any], SpecialTokens]:
    """The LlamaConfig fields of a ``config.json`` of Llama's blocks (Llama's own, and the
    mixtures of experts built on them, hf/moe.py), and its special token ids.

    ``defaults``: the transformers config class's defaults for absent keys;
    ``default_theta``: its rope theta when the file gives none.
    """
    require(hf_config, defaults, "hidden_act", ("silu",), "distlm's Llama feed-forward is SwiGLU with silu")
    require(hf_config, defaults, "attention_bias", (False,), "distlm's Llama attention projections have no bias")

    rope_key, rope, type_key = _rope_settings(hf_config)
    rope_type = rope.get(type_key, "default")
    if rope_type not in ("default", "llama3"):
        raise refuse(f"{rope_key}.{type_key}", rope_type, "distlm implements the rope types default and llama3 only")
    partial = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise refuse("partial_rotary_factor", partial, "distlm rotates every dimension of a head (1.0)")
    rope_fields: dict[str, Any] = {}
    max_seq_len = setting(hf_config, defaults, "max_position_embeddings")
    if rope_type == "llama3":
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if name not in rope:
                raise UsageError(f"config.json {rope_key} of rope type llama3 lacks {name}")
        rope_fields = {
            "rope_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            # transformers falls back to max_position_embeddings, as here.
            "rope_original_max_seq_len": int(rope.get("original_max_position_embeddings", max_seq_len)),
        }

    dim = setting(hf_config, defaults, "hidden_size")
    n_heads = setting(hf_config, defaults, "num_attention_heads")
    kv_heads = setting(hf_config, defaults, "num_key_value_heads") or n_heads
    head_dim = setting(hf_config, defaults, "head_dim") or dim // n_heads
    tokens = SpecialTokens.from_hf(hf_config, defaults)
    fields = dict(
        dim=dim,
        n_layers=setting(hf_config, defaults, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=None if kv_heads == n_heads else kv_heads,
        head_size=None if dim % n_heads == 0 and head_dim == dim // n_heads else head_dim,
        ffn_dim=setting(hf_config, defaults, "intermediate_size"),
        norm_eps=float(setting(hf_config, defaults, "rms_norm_eps")),
        rope_theta=float(rope.get("rope_theta", hf_config.get("rope_theta", default_theta))),
        rope_type=rope_type,
        **rope_fields,
        tie_word_embeddings=bool(setting(hf_config, defaults, "tie_word_embeddings")),
        max_seq_len=max_seq_len,
        dropout=0.0,
        attention_dropout=float(setting(hf_config, defaults, "attention_dropout")),
        vocab_size=setting(hf_config, defaults, "vocab_size"),
        padding_idx=padding_idx_of(tokens),
    )
    return fields, tokens


def padding_idx_of(tokens: SpecialTokens) -> int:
    """distlm's padding id for a Llama: ``pad_token_id``, else the (first) end-of-sequence id.

    The id is only recorded (causal attention needs no padding mask; sequence parallel
    pads on the right and cuts the logits back), and Llama checkpoints usually define no
    pad token; transformers' generation pads with the end-of-sequence id then, as here.
    """
    if tokens.pad_token_id is not None:
        return tokens.pad_token_id
    eos = tokens.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return 0 if eos is None else eos


def config_to_hf(config: LlamaConfig, tokens: SpecialTokens, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``config`` for transformers' LlamaForCausalLM."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **llama_settings(config),
        "mlp_bias": False,
        "pretraining_tp": 1,
        **tokens.to_hf(),
        "dtype": str(dtype).removeprefix("torch."),
    }


def llama_settings(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` settings of Llama's blocks, which the mixtures of experts built on
    them share (hf/moe.py); ``intermediate_size`` is the dense feed-forward's."""
    if config.dim % config.n_heads != 0:
        raise UsageError(
            f"model setting n_heads={config.n_heads} does not divide dim={config.dim}, which transformers' "
            "LlamaConfig requires even with head_dim set; such a model cannot be exported to Hugging Face"
        )
    rope: dict[str, Any] = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type == "llama3":
        rope.update(
            factor=config.rope_factor,
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=config.rope_original_max_seq_len,
        )
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": config.attention_dropout,
        "rope_parameters": rope,
        # transformers 4.x's form of the same settings; 5.x reads it as well.
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "initializer_range": 0.02,
        "use_cache": True,
    }


def generation_config(tokens: SpecialTokens) -> dict[str, Any]:
    """``generation_config.json``: the special token ids generation starts, stops and pads with."""
    ids = {name: value for name, value in tokens.to_hf().items() if value is not None}
    return {"_from_model_config": True, **ids}


# ----------------------------------------------------------------------- tensors


def hf_name(name: str) -> str:
    """The Hugging Face name of distlm tensor ``name``."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"distlm Llama tensor {name!r} has no Hugging Face counterpart")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def to_rotate_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a wq/wk weight from Meta's adjacent-pair layout to Hugging Face's halves."""
    rows, columns = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def to_adjacent_pairs(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q_proj/k_proj weight from Hugging Face's halves to Meta's adjacent pairs."""
    rows, columns = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def _rotary_heads(config: LlamaConfig, name: str) -> int | None:
    """How many heads a wq/wk tensor holds (None for every other tensor)."""
    if name.endswith("attention.wq.weight"):
        return config.n_heads
    if name.endswith("attention.wk.weight"):
        return config.kv_heads
    return None


def import_part(config: LlamaConfig, name: str, read: Read, region: Region | None = None) -> torch.Tensor:
    """``region`` of distlm tensor ``name`` (all of it for None), read from the Hugging Face files.

    Every tensor but wq and wk is a plain rename, so only the region is read. The rotary
    permutation of wq and wk moves rows within a head, so their rows come from the whole
    heads the region touches (at most one partial head more at each end), and only the
    region's columns.
    """
    source = hf_name(name)
    heads = _rotary_heads(config, name)
    if heads is None:
        return read(source, region)
    if region is None:
        return to_adjacent_pairs(read(source, None), heads)
    rows, columns = region
    head_dim = config.head_dim
    first, end = rows.start // head_dim, -(-rows.stop // head_dim)
    if first >= end:  # no rows: nothing to permute
        return read(source, region)
    covering = read(source, (slice(first * head_dim, end * head_dim), columns))
    skip = first * head_dim
    return to_adjacent_pairs(covering, end - first)[rows.start - skip:rows.stop - skip]


def export_tensors(config: LlamaConfig, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face (name, tensor) pairs made from distlm tensor ``name`` (one for Llama).

    Shape-only work, so meta tensors give the names and shapes without any data.
    """
    heads = _rotary_heads(config, name)
    yield hf_name(name), tensor if heads is None else to_rotate_half(tensor, heads)


ADAPTER = HFAdapter(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, model_class=MODEL_CLASS, config_class=CONFIG_CLASS,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, generation_config=generation_config,
    from_hf=import_part, to_hf=export_tensors,
)
