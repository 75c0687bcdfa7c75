"""RoBERTa's sizes as distlm builds it: post-norm blocks with biases, learned positions with
fairseq's padding offset, and an LM head (dense, LayerNorm, bias) whose output projection is
the token embedding. Torch-free."""

from __future__ import annotations

from distlm.models.family import FamilySizes
from distlm.models.roberta.config import RobertaConfig
from distlm.models.sizes import LocalParameters, ModelShape, ParameterGroups


def shape(config: RobertaConfig) -> ModelShape:
    return ModelShape(
        family="roberta", dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
        n_kv_heads=config.n_heads, head_dim=config.dim // config.n_heads, ffn_dim=config.ffn_dim,
        vocab_size=config.vocab_size, max_positions=config.max_positions, padding_idx=config.padding_idx,
        tied_output=True,
    )


def parameter_groups(s: ModelShape) -> ParameterGroups:
    d, f, v = s.dim, s.ffn_dim, s.vocab_size
    output = v * d
    attention = 3 * (d * s.attention_dim + s.attention_dim) + s.attention_dim * d + d
    block = attention + 2 * d + (d * f + f) + (f * d + d) + 2 * d  # attention, 2 LayerNorms, fc1, fc2
    positions = (s.max_positions + s.padding_idx + 1) * d
    embedding = v * d + positions + 2 * d  # token and position tables, embedding LayerNorm
    head = (d * d + d) + 2 * d + v  # LM head dense, LayerNorm, output bias; the projection is tied
    # The tied projection multiplies; so does the embedding LayerNorm (torchtitan counts norms too).
    lookups = embedding - output - 2 * d
    return ParameterGroups(embedding=embedding, per_block=block, head=head, output_projection=output, blocks=s.n_layers,
                           lookups=lookups, output_head=output + head)


def parameter_tensors(s: ModelShape) -> int:
    # Token and position tables and the embedding LayerNorm's two; per block the four attention
    # projections, fc1 and fc2 (weight and bias each) and two LayerNorms; the LM head's dense,
    # LayerNorm and output bias.
    return 4 + 16 * s.n_layers + 5


def local_parameters(s: ModelShape, tp: int, ep: int = 1) -> LocalParameters:
    """Tensor parallel splits the encoder projections (row-wise biases and LayerNorms stay
    whole) and keeps the embeddings and the tied LM head replicated."""
    groups = parameter_groups(s)
    d = s.dim
    whole = d + 2 * d + d + 2 * d  # out_proj bias, LayerNorm, fc2 bias, LayerNorm
    block = (groups.per_block - whole) / tp + whole
    return LocalParameters(
        embedding=groups.embedding, per_block=block, head=groups.head, blocks=s.n_layers,
        matmul_embedding=groups.output_projection, matmul_head=groups.head,
    )


def describe(config: RobertaConfig) -> str:
    return f"{config.max_positions} learned positions"


SIZES = FamilySizes(shape=shape, parameter_groups=parameter_groups, parameter_tensors=parameter_tensors,
                    local_parameters=local_parameters, output_split_by_tp=False, describe=describe)
