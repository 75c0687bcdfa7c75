"""Llama's sizes as distlm builds it: pre-norm blocks without biases, SwiGLU, grouped-query
attention, RMSNorm, rotary positions (no table), and an output projection of its own or tied
to the token embedding. Torch-free."""

from __future__ import annotations

from distlm.models.family import FamilySizes
from distlm.models.llama.config import LlamaConfig
from distlm.models.sizes import LocalParameters, ModelShape, ParameterGroups


def shape(config: LlamaConfig) -> ModelShape:
    return ModelShape(
        family="llama", dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
        n_kv_heads=config.kv_heads, head_dim=config.head_dim, ffn_dim=config.ffn_hidden_dim,
        vocab_size=config.vocab_size, max_positions=config.max_seq_len,
        tied_output=config.tie_word_embeddings,
    )


def attention_parameters(s: ModelShape) -> int:
    """wq, wk, wv and wo, and Qwen3's query/key norms."""
    d = s.dim
    return d * s.attention_dim + 2 * d * s.kv_dim + s.attention_dim * d + (2 * s.head_dim if s.qk_norm else 0)


def parameter_groups(s: ModelShape) -> ParameterGroups:
    d, v = s.dim, s.vocab_size
    output = v * d
    block = attention_parameters(s) + 3 * d * s.ffn_dim + 2 * d  # attention, w1 w2 w3, two RMSNorm weights
    head = d + (0 if s.tied_output else output)  # final norm, output
    return ParameterGroups(embedding=v * d, per_block=block, head=head, output_projection=output, blocks=s.n_layers,
                           lookups=v * d - (output if s.tied_output else 0), output_head=output)


def parameter_tensors(s: ModelShape) -> int:
    # Token table; wq wk wv wo, w1 w2 w3 and two norms a block; final norm; the output unless tied.
    return 1 + 9 * s.n_layers + 1 + (0 if s.tied_output else 1)


def local_parameters(s: ModelShape, tp: int, ep: int = 1) -> LocalParameters:
    """Tensor parallel splits the block projections, the vocabulary embedding and the output
    layer, and keeps the norms whole."""
    groups = parameter_groups(s)
    d = s.dim
    norms = 2 * d
    block = (groups.per_block - norms) / tp + norms
    if tp > s.n_kv_heads:
        # Fewer key/value heads than ranks: each rank keeps one whole head (replicated
        # tp / n_kv_heads times), as neuronx-distributed lays out GQA.
        kv_split = 2 * d * s.kv_dim / tp
        block += 2 * d * s.head_dim - kv_split
    output = 0 if s.tied_output else groups.output_projection
    head = output / tp + d
    embedding = groups.embedding / tp
    return LocalParameters(
        embedding=embedding, per_block=block, head=head, blocks=s.n_layers,
        matmul_embedding=embedding if s.tied_output else 0.0, matmul_head=head,
    )


def describe(config: LlamaConfig) -> str:
    """Rotary positions with their base and scaling, and whether the output is tied."""
    scaling = "no scaling"
    if config.llama3_scaling is not None:
        factor, low, high, original = config.llama3_scaling
        scaling = f"llama3 scaling (factor {factor:g}, low {low:g}, high {high:g}, original {original} positions)"
    tied = ", output tied to the embedding" if config.tie_word_embeddings else ""
    return f"{config.max_seq_len} rotary positions (theta {config.rope_theta:g}, {scaling}){tied}"


SIZES = FamilySizes(shape=shape, parameter_groups=parameter_groups, parameter_tensors=parameter_tensors,
                    local_parameters=local_parameters, output_split_by_tp=True, describe=describe)
