"""Model FLOPs per token and exact parameter counts.

FLOPs are counted as torchtitan counts them for MFU: 6 FLOPs per token for every
parameter a matrix multiply uses (2 in forward, 4 in backward), plus the attention
score and value products, 12 x layers x (heads x head size) x sequence length per token,
with no discount for the causal mask and no recomputation (with document masks, each
document's own length instead: ``attention_flops_per_pair``). Embedding lookups do no
matrix multiply, so their tables are left out, except where a table is also the output
projection (RoBERTa's tied LM head), which multiplies like any weight.

The peak FLOP/s these are divided by are facts of the hardware: ``distlm.backends.hardware``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from distlm.data.tokenizer import byte_dictionary
from distlm.errors import UsageError
from distlm.models import ARCHS, LlamaConfig, RobertaConfig, arch_config, arch_task
from distlm.models.hf import config_from_hf
from distlm.models.moe import MoEConfig

# The model_types of a Hugging Face config.json the planner reads; the mixtures of experts'
# through their adapters (distlm/models/hf/moe.py), which refuse what distlm cannot build.
FAMILIES = ("llama", "roberta", "qwen3_moe", "mixtral")

@dataclass(frozen=True)
class ModelShape:
    """The sizes that fix a transformer's parameters and FLOPs, laid out as distlm builds it."""

    family: str
    """``llama`` (pre-norm, SwiGLU, no biases, RMSNorm) or ``roberta`` (post-norm, GELU, biases, LayerNorm)."""
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_positions: int
    padding_idx: int = 1
    """RoBERTa's learned position table has ``max_positions + padding_idx + 1`` rows (fairseq's offset)."""
    tied_output: bool = False
    """Whether the output projection is the token embedding (always for RoBERTa)."""
    n_experts: int = 0
    """Family ``qwen3_moe`` (Llama's blocks with a mixture of experts): routed experts per MoE layer."""
    top_k: int = 0
    """Experts each token uses in an MoE layer."""
    moe_ffn_dim: int = 0
    """Hidden size of each expert's SwiGLU."""
    moe_every: int = 1
    """Block i is an MoE block when (i + 1) is a multiple of this; the others are dense (``ffn_dim``)."""
    n_shared_experts: int = 0
    """Experts every token passes through besides its routed ones."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys (Qwen3)."""

    @property
    def attention_dim(self) -> int:
        """Width of the query (and attention output) projection: heads x head size."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_moe_layers(self) -> int:
        return sum((index + 1) % self.moe_every == 0 for index in range(self.n_layers)) if self.n_experts else 0

    @property
    def inactive_expert_parameters(self) -> int:
        """Expert parameters a token does not use: all but its top-k of each MoE layer's experts."""
        return self.n_moe_layers * (self.n_experts - self.top_k) * 3 * self.dim * self.moe_ffn_dim


def default_vocab_size(arch: str) -> int:
    """The vocabulary ``arch`` builds with when no data decides it: its own config's (the
    published archs carry their namesake's), else distlm's byte vocabulary (4 specials +
    256 bytes, + ``<mask>`` for masked LM), which the tiny archs train with."""
    configured = arch_config(arch).vocab_size
    if configured > 0:
        return configured
    return len(byte_dictionary()) + (1 if arch_task(arch) == "masked_lm" else 0)


def model_shape(model: object, vocab_size: int | None = None) -> ModelShape:
    """The shape of a distlm arch name, a ``config.json`` path of a Hugging Face Llama or
    RoBERTa, a ``LlamaConfig``/``RobertaConfig``, a built distlm model, or a ``ModelShape``.

    ``vocab_size`` overrides the vocabulary; a config with ``vocab_size=0`` (the arch
    registry's own) needs it.
    """
    if isinstance(model, ModelShape):
        shape = model
    elif isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        if not isinstance(config, (LlamaConfig, RobertaConfig)):  # MoEConfig is a LlamaConfig
            raise UsageError(f"{type(model).__name__} has no distlm LlamaConfig/RobertaConfig; pass a ModelShape")
        shape = _shape_of_config(config)
    elif isinstance(model, (LlamaConfig, RobertaConfig)):
        shape = _shape_of_config(model)
    elif isinstance(model, (str, Path)):
        name = str(model)
        if name in ARCHS:
            shape = _shape_of_config(arch_config(name))
            if vocab_size is None:
                vocab_size = default_vocab_size(name)
        elif name.endswith(".json") or Path(name).is_file():
            shape = shape_from_hf_config(name)
        else:
            raise UsageError(
                f"--arch {name} is neither a distlm arch ({', '.join(ARCHS)}) nor a Hugging Face config.json file"
            )
    else:
        raise TypeError(f"cannot read a model shape from {type(model).__name__}")
    if vocab_size is not None:
        if vocab_size <= 0:
            raise UsageError(f"--vocab-size must be positive, got {vocab_size}")
        shape = dataclasses.replace(shape, vocab_size=vocab_size)
    if shape.vocab_size <= 0:
        raise UsageError("the model's vocab_size is 0 (set from the data at build time); pass --vocab-size")
    return shape


def _shape_of_config(config: LlamaConfig | RobertaConfig) -> ModelShape:
    if isinstance(config, MoEConfig):
        return ModelShape(
            family="qwen3_moe", dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
            n_kv_heads=config.kv_heads, head_dim=config.head_dim, ffn_dim=config.ffn_hidden_dim,
            vocab_size=config.vocab_size, max_positions=config.max_seq_len, padding_idx=config.padding_idx,
            tied_output=config.tie_word_embeddings, n_experts=config.n_experts, top_k=config.top_k,
            moe_ffn_dim=config.expert_ffn_dim, moe_every=config.moe_every, n_shared_experts=config.n_shared_experts,
            qk_norm=config.qk_norm,
        )
    if isinstance(config, LlamaConfig):
        return ModelShape(
            family="llama", dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
            n_kv_heads=config.kv_heads, head_dim=config.head_dim, ffn_dim=config.ffn_hidden_dim,
            vocab_size=config.vocab_size, max_positions=config.max_seq_len, padding_idx=config.padding_idx,
        )
    return ModelShape(
        family="roberta", dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
        n_kv_heads=config.n_heads, head_dim=config.dim // config.n_heads, ffn_dim=config.ffn_dim,
        vocab_size=config.vocab_size, max_positions=config.max_positions, padding_idx=config.padding_idx,
        tied_output=True,
    )


def shape_from_hf_config(path: str | Path) -> ModelShape:
    """Read the standard fields of a Hugging Face ``config.json`` (``model_type`` llama, roberta,
    qwen3_moe or mixtral).

    The shape is the one distlm would build: for RoBERTa, the position table holds
    ``max_position_embeddings`` rows (fairseq's padding offset included) and the one-row
    token-type embedding and pooler of Hugging Face's model are not part of it.
    """
    path = Path(path)
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--arch {path}: no such file") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--arch {path}: not a readable JSON config ({exc})") from None
    if not isinstance(fields, dict):
        raise UsageError(f"--arch {path}: a config.json holds one JSON object")
    model_type = fields.get("model_type")
    if model_type not in FAMILIES:
        raise UsageError(
            f"--arch {path}: model_type {model_type!r} is not supported; the planner reads {', '.join(FAMILIES)}"
        )
    if model_type in ("qwen3_moe", "mixtral"):
        try:
            return _shape_of_config(config_from_hf(fields)[1])
        except UsageError as err:
            raise UsageError(f"--arch {path}: {err}") from None

    def read(name: str, default: int | None = None) -> int:
        value = fields.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UsageError(f"--arch {path}: field {name} must be a positive integer, got {value!r}")
        return value

    dim, n_heads = read("hidden_size"), read("num_attention_heads")
    if model_type == "llama":
        # Some configs (Gemma-style) give head_dim explicitly; Llama's leave it to hidden_size / heads.
        head_dim = read("head_dim") if fields.get("head_dim") is not None else dim // n_heads
        return ModelShape(
            family="llama", dim=dim, n_layers=read("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=read("num_key_value_heads", n_heads), head_dim=head_dim,
            ffn_dim=read("intermediate_size"), vocab_size=read("vocab_size"),
            max_positions=read("max_position_embeddings"),
            tied_output=bool(fields.get("tie_word_embeddings", False)),
        )
    padding_idx = fields.get("pad_token_id", 1)
    if not isinstance(padding_idx, int) or padding_idx < 0:
        raise UsageError(f"--arch {path}: field pad_token_id must be a non-negative integer, got {padding_idx!r}")
    table_rows = read("max_position_embeddings")
    if table_rows <= padding_idx + 1:
        raise UsageError(
            f"--arch {path}: max_position_embeddings {table_rows} leaves no positions after the padding offset"
        )
    return ModelShape(
        family="roberta", dim=dim, n_layers=read("num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=dim // n_heads, ffn_dim=read("intermediate_size"), vocab_size=read("vocab_size"),
        max_positions=table_rows - padding_idx - 1, padding_idx=padding_idx, tied_output=True,
    )


# ------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParameterGroups:
    """Parameter counts by role, the pieces every estimate here is built from."""

    embedding: int
    """Lookup tables (token, and RoBERTa's positions); the tied output projection counts here once."""
    per_block: int
    """One transformer block."""
    head: int
    """After the blocks: final norm, untied output projection, RoBERTa's LM-head dense/norm/bias."""
    output_projection: int
    """Parameters of the vocabulary projection (shared with ``embedding`` when tied)."""
    blocks: int
    uneven_blocks: int = 0
    """Parameters the blocks hold beyond ``blocks x per_block``: a mixture of experts whose
    MoE blocks (``per_block``) alternate with smaller dense ones has a negative amount here."""

    @property
    def total(self) -> int:
        return self.embedding + self.blocks * self.per_block + self.uneven_blocks + self.head


def parameter_groups(model: object) -> ParameterGroups:
    """Exact parameter counts of the model distlm builds for ``model`` (see ``model_shape``)."""
    s = model_shape(model)
    d, f, v = s.dim, s.ffn_dim, s.vocab_size
    output = v * d
    if s.family in ("llama", "qwen3_moe"):
        attention = d * s.attention_dim + 2 * d * s.kv_dim + s.attention_dim * d
        attention += 2 * s.head_dim if s.qk_norm else 0
        block = attention + 3 * d * f + 2 * d  # wq wk wv wo, w1 w2 w3, two RMSNorm weights
        head = d + (0 if s.tied_output else output)  # final norm, output
        uneven = 0
        if s.family == "qwen3_moe":
            # The router, the stacked experts and the shared experts in place of w1 w2 w3.
            dense, e = block, s.moe_ffn_dim
            block = attention + s.n_experts * d + (s.n_experts + s.n_shared_experts) * 3 * d * e + 2 * d
            uneven = (s.n_layers - s.n_moe_layers) * (dense - block)
        return ParameterGroups(embedding=v * d, per_block=block, head=head, output_projection=output, blocks=s.n_layers,
                               uneven_blocks=uneven)
    attention = 3 * (d * s.attention_dim + s.attention_dim) + s.attention_dim * d + d
    block = attention + 2 * d + (d * f + f) + (f * d + d) + 2 * d  # attention, 2 LayerNorms, fc1, fc2
    positions = (s.max_positions + s.padding_idx + 1) * d
    embedding = v * d + positions + 2 * d  # token and position tables, embedding LayerNorm
    head = (d * d + d) + 2 * d + v  # LM head dense, LayerNorm, output bias; the projection is tied
    return ParameterGroups(embedding=embedding, per_block=block, head=head, output_projection=output, blocks=s.n_layers)


def count_parameter_tensors(model: object) -> int:
    """How many parameter tensors the model distlm builds for ``model`` holds (tied ones
    once): per-tensor costs, such as DTensor's dispatch in the optimizer step, scale with it."""
    s = model_shape(model)
    if s.family == "llama":
        # Token table; wq wk wv wo, w1 w2 w3 and two norms a block; final norm; the output unless tied.
        return 1 + 9 * s.n_layers + 1 + (0 if s.tied_output else 1)
    if s.family == "qwen3_moe":
        # As Llama's, plus the query/key norms; an MoE block's router, two stacked expert tensors
        # and the shared experts' three in place of w1 w2 w3.
        moe = s.n_moe_layers
        per_block = 6 + (2 if s.qk_norm else 0)
        return (2 + (0 if s.tied_output else 1) + per_block * s.n_layers + 3 * (s.n_layers - moe)
                + moe * (3 + (3 if s.n_shared_experts else 0)))
    # Token and position tables and the embedding LayerNorm's two; per block the four attention
    # projections, fc1 and fc2 (weight and bias each) and two LayerNorms; the LM head's dense,
    # LayerNorm and output bias.
    return 4 + 16 * s.n_layers + 5


def count_parameters(config: object) -> int:
    """Exact parameter count of the model distlm builds from ``config`` (an arch name,
    a config with its vocabulary set, a config.json path, a model or a ``ModelShape``);
    tied weights count once, as ``sum(p.numel() for p in model.parameters())`` does."""
    return parameter_groups(config).total


def matmul_parameters(model: object) -> int:
    """Parameters multiplied per token: all but the lookup tables, with a tied output
    projection counted (it multiplies even though its storage is the embedding's)."""
    s = model_shape(model)
    groups = parameter_groups(s)
    lookups = groups.embedding - (groups.output_projection if s.tied_output else 0)
    if s.family == "roberta":
        lookups -= 2 * s.dim  # the embedding LayerNorm is not a lookup (torchtitan counts norms too)
    return groups.total - lookups


def active_matmul_parameters(model: object) -> int:
    """``matmul_parameters`` a token multiplies: a mixture of experts' token uses its top-k
    routed experts of each MoE layer, not all of them (the rest are the same as ``matmul_parameters``)."""
    s = model_shape(model)
    return matmul_parameters(s) - s.inactive_expert_parameters


def flops_per_token(model_config_or_model: object, seq_len: int, output_fraction: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per input token at sequence length ``seq_len``:
    ``6 x matmul parameters + 12 x layers x heads x head size x seq_len``, with no
    activation recomputation. A mixture of experts counts its active parameters (a token's
    top-k experts, ``active_matmul_parameters``), as torchtitan counts them.

    ``output_fraction``: the share of positions at which the model computes its output, 1
    for a causal LM (every position). A masked LM computes its LM head (RoBERTa's dense
    layer, norm and output projection) only at the masked positions: pass the masked
    fraction of the tokens (``--mask-prob`` in expectation).
    """
    if seq_len <= 0:
        raise UsageError(f"sequence length must be positive, got {seq_len}")
    if not 0.0 <= output_fraction <= 1.0:
        raise UsageError(f"the fraction of positions with an output must be in [0, 1], got {output_fraction}")
    s = model_shape(model_config_or_model)
    matmuls = active_matmul_parameters(s)
    output = output_head_parameters(s)
    return 6.0 * (matmuls - output + output_fraction * output) + attention_flops_per_pair(s) * seq_len


def attention_flops_per_pair(model: object) -> float:
    """Training FLOPs of the attention score and value products for one (query, key) pair of a
    sequence: ``12 x layers x heads x head size``. A sequence of T tokens counts T^2 pairs, as
    :func:`flops_per_token` counts them (no causal discount); packed with document masks, a
    block counts the sum of its documents' squared lengths, the attention actually computed."""
    s = model_shape(model)
    return 12.0 * s.n_layers * s.attention_dim


def output_head_parameters(model: object) -> int:
    """Parameters a token multiplies only where the model computes its output: the output
    projection, and RoBERTa's LM head before it (dense layer, LayerNorm, output bias)."""
    s = model_shape(model)
    groups = parameter_groups(s)
    return groups.output_projection + (groups.head if s.family == "roberta" else 0)


def model_flops_utilization(
    tokens_per_s: float, model_flops_per_token: float, peak_flops_per_rank: float, ranks: int
) -> float:
    """MFU: the model FLOP/s a run achieves over the peak of all its ranks."""
    return tokens_per_s * model_flops_per_token / (peak_flops_per_rank * ranks)
