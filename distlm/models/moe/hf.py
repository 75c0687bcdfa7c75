"""Hugging Face ``Qwen3MoeForCausalLM`` and ``MixtralForCausalLM`` <-> distlm ``MoECausalLM``.

Both are Llama's blocks (hf/llama.py maps embeddings, attention, norms, dense feed-forwards
and the output, rotary permutation of q/k included) with a mixture of experts in the
feed-forward. What differs, ``i`` the layer and ``j`` the expert:

==========================================================  ================================================
Qwen3-MoE ``model.layers.i.mlp.gate.weight``                ``layers.i.feed_forward.gate.weight``
Mixtral ``model.layers.i.block_sparse_moe.gate.weight``     (the router)
Qwen3-MoE ``model.layers.i.mlp.experts.j.gate_proj.weight``  ``layers.i.feed_forward.experts.gate_up_proj[j, :F]``
Mixtral ``...block_sparse_moe.experts.j.w1.weight``
Qwen3-MoE ``...mlp.experts.j.up_proj.weight``                ``layers.i.feed_forward.experts.gate_up_proj[j, F:]``
Mixtral ``...block_sparse_moe.experts.j.w3.weight``
Qwen3-MoE ``...mlp.experts.j.down_proj.weight``              ``layers.i.feed_forward.experts.down_proj[j]``
Mixtral ``...block_sparse_moe.experts.j.w2.weight``
Qwen3-MoE ``model.layers.i.self_attn.q_norm.weight``         ``layers.i.attention.q_norm.weight`` (permuted)
Qwen3-MoE ``model.layers.i.self_attn.k_norm.weight``         ``layers.i.attention.k_norm.weight`` (permuted)
==========================================================  ================================================

The files hold each expert as its own tensors, as the published checkpoints do and as
transformers' ``save_pretrained`` writes them (transformers 5 stacks them into
``gate_up_proj``/``down_proj`` as distlm does, but only in memory). distlm keeps the
experts stacked, so one distlm tensor is made from, or makes, ``2E`` (``E``) file tensors;
a rank's shard of experts (expert parallelism splits the first dimension) reads only its
own experts' tensors, and of those only its rows and columns.

The query/key norms weigh each dimension of a head, so their weights take the same
within-head rotary permutation as the rows of wq and wk.

Which layout a distlm model exports to: Qwen3-MoE when it has the query/key norms
(``qk_norm``, which Mixtral lacks), Mixtral otherwise (Qwen3-MoE always has them).
Config: Qwen3-MoE's ``num_experts`` (transformers 5 writes ``num_local_experts``, both
read), ``num_experts_per_tok`` = top_k, ``moe_intermediate_size`` = moe_ffn_dim,
``decoder_sparse_step`` = moe_every, ``intermediate_size`` = ffn_dim (the dense layers'),
``norm_topk_prob``; Mixtral's ``num_local_experts``, ``num_experts_per_tok`` and
``intermediate_size`` = moe_ffn_dim (every layer is a mixture, top-k weights always
renormalised); both ``router_aux_loss_coef`` = aux_loss_coef.

Refused on import: Qwen3-MoE's ``mlp_only_layers`` and ``use_sliding_window``, Mixtral's
``sliding_window`` and ``router_jitter_noise``, and what hf/llama.py refuses. Refused on
export: what neither transformers class has (the sigmoid router, a selection bias, shared
experts, a route scale), and for Mixtral dense layers or unnormalised top-k weights.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from distlm.errors import UsageError
from distlm.models.hf.common import HFAdapter, Read, Region, SpecialTokens, check_architectures, refuse, setting
from distlm.models.llama import hf as llama
from distlm.models.moe.config import MoEConfig
from distlm.models.moe.model import MoECausalLM

# transformers' class defaults (Qwen3MoeConfig, MixtralConfig), used for keys a config.json
# leaves out, as transformers itself does when it reads the file.
QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
MIXTRAL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,  # Mixtral's attention has no bias setting: always none
    "sliding_window": None,
    "attention_dropout": 0.0,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}


@dataclass(frozen=True)
class Layout:
    """What tells the two transformers classes apart."""

    model_type: str
    architecture: str
    defaults: dict[str, Any]
    default_theta: float
    """The rope theta of a config.json that gives none (transformers' ``default_theta``)."""
    moe_module: str
    """The feed-forward's name in a layer of the files."""
    expert_names: tuple[str, str, str]
    """Each expert's gate, up and down projection."""
    qk_norm: bool
    experts_key: str
    """The config.json key of the routed experts per layer that this layout writes."""


QWEN3_MOE = Layout("qwen3_moe", "Qwen3MoeForCausalLM", QWEN3_MOE_DEFAULTS, 10000.0, "mlp",
                   ("gate_proj", "up_proj", "down_proj"), qk_norm=True, experts_key="num_experts")
MIXTRAL = Layout("mixtral", "MixtralForCausalLM", MIXTRAL_DEFAULTS, 1e6, "block_sparse_moe", ("w1", "w3", "w2"),
                 qk_norm=False, experts_key="num_local_experts")

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_QK_NORMS = ("attention.q_norm.weight", "attention.k_norm.weight")
_ROUTER = "feed_forward.gate.weight"
_BIAS = "feed_forward.gate.e_score_correction_bias"
_EXPERTS = ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj")


# ------------------------------------------------------------------------ config


def _experts_per_layer(layout: Layout, hf_config: dict[str, Any]) -> int:
    """Routed experts per layer: ``num_experts`` (Qwen3-MoE's published files) or
    ``num_local_experts`` (Mixtral's, and what transformers 5 writes for both)."""
    given = {key: hf_config[key] for key in ("num_experts", "num_local_experts") if hf_config.get(key) is not None}
    if len(set(given.values())) > 1:
        raise refuse("num_experts", given["num_experts"],
                     f"num_local_experts={given['num_local_experts']} says otherwise; keep one of them")
    return next(iter(given.values())) if given else layout.defaults[layout.experts_key]


def config_from_hf(layout: Layout, hf_config: dict[str, Any]) -> tuple[MoEConfig, SpecialTokens]:
    """distlm's config (and the special token ids) of a Qwen3-MoE or Mixtral ``config.json``."""
    if hf_config.get("model_type") != layout.model_type:
        raise refuse("model_type", hf_config.get("model_type"), f"expected {layout.model_type}")
    check_architectures(hf_config, layout.architecture)
    defaults = layout.defaults
    if layout is QWEN3_MOE:
        if setting(hf_config, defaults, "use_sliding_window"):
            raise refuse("use_sliding_window", True, "distlm's attention sees every earlier position")
        if setting(hf_config, defaults, "mlp_only_layers"):
            raise refuse("mlp_only_layers", hf_config["mlp_only_layers"],
                         "distlm places dense layers by decoder_sparse_step only")
        experts = dict(moe_ffn_dim=setting(hf_config, defaults, "moe_intermediate_size"),
                       moe_every=setting(hf_config, defaults, "decoder_sparse_step"),
                       norm_topk_prob=bool(setting(hf_config, defaults, "norm_topk_prob")))
    else:
        if setting(hf_config, defaults, "sliding_window") is not None:
            raise refuse("sliding_window", hf_config["sliding_window"],
                         "distlm's attention sees every earlier position")
        if setting(hf_config, defaults, "router_jitter_noise"):
            raise refuse("router_jitter_noise", hf_config["router_jitter_noise"],
                         "distlm's router does not jitter its inputs; set it to 0")
        experts = dict(moe_ffn_dim=setting(hf_config, defaults, "intermediate_size"), moe_every=1,
                       norm_topk_prob=True)
    fields, tokens = llama.llama_fields(hf_config, defaults, layout.default_theta)
    config = MoEConfig(
        **fields, **experts,
        n_experts=_experts_per_layer(layout, hf_config),
        top_k=setting(hf_config, defaults, "num_experts_per_tok"),
        aux_loss_coef=float(setting(hf_config, defaults, "router_aux_loss_coef")),
        qk_norm=layout.qk_norm,
    )
    config.validate()
    return config, tokens


def check_exportable(layout: Layout, config: MoEConfig) -> None:
    """Refuse, in one line, a model the layout's transformers class cannot compute."""
    cannot = f"; such a model cannot be exported to Hugging Face's {layout.architecture}"
    if config.qk_norm != layout.qk_norm:
        has = "has" if config.qk_norm else "lacks"
        raise UsageError(f"model setting qk_norm={config.qk_norm}: the model {has} query/key norms, which "
                         f"{layout.architecture} {'lacks' if config.qk_norm else 'has'}{cannot}")
    if config.router != "softmax":
        raise UsageError(f"model setting router={config.router!r}: transformers routes by softmax{cannot}")
    if config.uses_expert_bias:
        raise UsageError(f"model setting bias_update_rate={config.bias_update_rate:g}: the auxiliary-loss-free "
                         f"balancing routes with a bias per expert, which transformers has no place for{cannot}")
    if config.n_shared_experts:
        raise UsageError(f"model setting n_shared_experts={config.n_shared_experts}: transformers has no "
                         f"ungated shared experts{cannot}")
    if config.route_scale != 1.0:
        raise UsageError(f"model setting route_scale={config.route_scale:g}: transformers does not scale the "
                         f"experts' weights{cannot}")
    if layout is MIXTRAL and config.moe_every != 1:
        raise UsageError(f"model setting moe_every={config.moe_every}: every Mixtral layer is a mixture of "
                         f"experts{cannot}")
    if layout is MIXTRAL and not config.norm_topk_prob:
        raise UsageError(f"model setting norm_topk_prob=False: Mixtral always renormalises the top-k weights{cannot}")


def config_to_hf(layout: Layout, config: MoEConfig, tokens: SpecialTokens, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``config`` for the layout's transformers class."""
    check_exportable(layout, config)
    experts: dict[str, Any] = {
        layout.experts_key: config.n_experts,
        "num_experts_per_tok": config.top_k,
        "router_aux_loss_coef": config.aux_loss_coef,
        "output_router_logits": False,
    }
    if layout is QWEN3_MOE:
        experts.update(moe_intermediate_size=config.expert_ffn_dim, decoder_sparse_step=config.moe_every,
                       mlp_only_layers=[], norm_topk_prob=config.norm_topk_prob, use_sliding_window=False,
                       sliding_window=None)
    else:
        experts.update(intermediate_size=config.expert_ffn_dim, router_jitter_noise=0.0, sliding_window=None)
    return {
        "architectures": [layout.architecture],
        "model_type": layout.model_type,
        **llama.llama_settings(config),
        **experts,
        **tokens.to_hf(),
        "dtype": str(dtype).removeprefix("torch."),
    }


# ----------------------------------------------------------------------- tensors


def _split(name: str) -> tuple[int, str] | None:
    match = _LAYER.fullmatch(name)
    return None if match is None else (int(match.group(1)), match.group(2))


def _expert_name(layout: Layout, layer: int, expert: int, projection: int) -> str:
    """The file's name of expert ``expert``'s gate (0), up (1) or down (2) projection."""
    return f"model.layers.{layer}.{layout.moe_module}.experts.{expert}.{layout.expert_names[projection]}.weight"


def _one_to_one_name(layout: Layout, layer: int, part: str) -> str | None:
    """The file's name of a router or query/key norm weight; None for any other tensor."""
    if part == _ROUTER:
        return f"model.layers.{layer}.{layout.moe_module}.gate.weight"
    if part in _QK_NORMS and layout.qk_norm:
        return f"model.layers.{layer}.self_attn.{part.split('.')[1]}.weight"
    return None


def _expert_blocks(config: MoEConfig, part: str) -> tuple[tuple[int, int, int], list[tuple[int, int]]]:
    """(shape of the stacked distlm tensor, [(projection, first row)] of the file tensors
    each expert's block is made of, stacked along the rows)."""
    hidden = config.expert_ffn_dim
    if part == _EXPERTS[0]:
        return (config.n_experts, 2 * hidden, config.dim), [(0, 0), (1, hidden)]
    return (config.n_experts, config.dim, hidden), [(2, 0)]


def _read_experts(layout: Layout, config: MoEConfig, layer: int, part: str, read: Read,
                  region: Region | None) -> torch.Tensor:
    """``region`` of a stacked expert tensor: of the experts it covers, the rows it covers of
    each file tensor, its columns only."""
    shape, blocks = _expert_blocks(config, part)
    experts, rows, columns = region if region is not None else tuple(slice(0, size) for size in shape)
    block_rows = shape[1] // len(blocks)
    stacked = []
    for expert in range(experts.start, experts.stop):
        pieces = []
        for projection, first in blocks:
            start, stop = max(rows.start - first, 0), min(rows.stop - first, block_rows)
            if start < stop:
                pieces.append(read(_expert_name(layout, layer, expert, projection), (slice(start, stop), columns)))
        if not pieces:  # no rows: an empty read still gives the dtype
            pieces.append(read(_expert_name(layout, layer, expert, blocks[0][0]), (slice(0, 0), columns)))
        stacked.append(torch.cat(pieces))
    if not stacked:  # no experts: likewise
        empty = read(_expert_name(layout, layer, 0, blocks[0][0]), (slice(0, 0), columns))
        return empty.new_empty((0, rows.stop - rows.start, empty.shape[1]))
    return torch.stack(stacked)


def import_part(layout: Layout, config: MoEConfig, name: str, read: Read, region: Region | None = None) -> torch.Tensor:
    """``region`` of distlm tensor ``name`` (all of it for None), read from the files; see the
    module docstring. Llama's tensors go through hf/llama.py."""
    split = _split(name)
    if split is None:
        return llama.import_part(config, name, read, region)
    layer, part = split
    if part in _EXPERTS:
        return _read_experts(layout, config, layer, part, read, region)
    if part == _BIAS:
        # transformers' classes route without a selection bias: it starts at 0, as
        # init_weights starts it (a run that adds the bias update to a published model).
        bias = torch.zeros(config.n_experts)
        return bias if region is None else bias[region]
    source = _one_to_one_name(layout, layer, part)
    if source is None:
        return llama.import_part(config, name, read, region)
    if part in _QK_NORMS:  # small: read whole, permuted as one head's rows
        weight = llama.to_adjacent_pairs(read(source, None).unsqueeze(-1), 1).squeeze(-1)
        return weight if region is None else weight[region]
    return read(source, region)


def export_tensors(layout: Layout, config: MoEConfig, name: str,
                   tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's (name, tensor) pairs made from distlm tensor ``name``: one per expert and
    projection for the stacked experts, one otherwise. Views and shape-only work, so meta
    tensors give the names and shapes without any data."""
    check_exportable(layout, config)
    split = _split(name)
    if split is None:
        yield from llama.export_tensors(config, name, tensor)
        return
    layer, part = split
    if part in _EXPERTS:
        _, blocks = _expert_blocks(config, part)
        block_rows = tensor.shape[1] // len(blocks)
        for expert in range(tensor.shape[0]):
            for projection, first in blocks:
                yield _expert_name(layout, layer, expert, projection), tensor[expert, first:first + block_rows]
        return
    target = _one_to_one_name(layout, layer, part)
    if target is None:
        yield from llama.export_tensors(config, name, tensor)
    elif part in _QK_NORMS:
        yield target, llama.to_rotate_half(tensor.unsqueeze(-1), 1).squeeze(-1)
    else:
        yield target, tensor


def _adapter(layout: Layout) -> HFAdapter:
    return HFAdapter(
        model_type=layout.model_type, architecture=layout.architecture, model_class=MoECausalLM,
        config_class=MoEConfig, config_from_hf=functools.partial(config_from_hf, layout),
        config_to_hf=functools.partial(config_to_hf, layout), generation_config=llama.generation_config,
        from_hf=functools.partial(import_part, layout), to_hf=functools.partial(export_tensors, layout),
        holds=lambda config: config.qk_norm == layout.qk_norm,
    )


QWEN3_MOE_ADAPTER = _adapter(QWEN3_MOE)
MIXTRAL_ADAPTER = _adapter(MIXTRAL)
