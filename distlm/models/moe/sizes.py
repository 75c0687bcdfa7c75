"""The mixture of experts' sizes: Llama's blocks (``distlm.models.llama.sizes``) whose
feed-forward, in every ``moe_every``-th block, is a router, the stacked routed experts and
the shared experts. Torch-free."""

from __future__ import annotations

from distlm.models.family import FamilySizes
from distlm.models.llama import sizes as llama_sizes
from distlm.models.moe.config import MoEConfig
from distlm.models.sizes import LocalParameters, ModelShape, ParameterGroups


def shape(config: MoEConfig) -> ModelShape:
    return ModelShape(
        family="qwen3_moe", dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
        n_kv_heads=config.kv_heads, head_dim=config.head_dim, ffn_dim=config.ffn_hidden_dim,
        vocab_size=config.vocab_size, max_positions=config.max_seq_len,
        tied_output=config.tie_word_embeddings, n_experts=config.n_experts, top_k=config.top_k,
        moe_ffn_dim=config.expert_ffn_dim, moe_every=config.moe_every, n_shared_experts=config.n_shared_experts,
        qk_norm=config.qk_norm,
    )


def parameter_groups(s: ModelShape) -> ParameterGroups:
    dense = llama_sizes.parameter_groups(s)
    d, e = s.dim, s.moe_ffn_dim
    # The router, the stacked experts and the shared experts in place of w1 w2 w3.
    experts = s.n_experts * d + (s.n_experts + s.n_shared_experts) * 3 * d * e
    block = llama_sizes.attention_parameters(s) + experts + 2 * d
    return ParameterGroups(embedding=dense.embedding, per_block=block, head=dense.head,
                           output_projection=dense.output_projection, blocks=s.n_layers, lookups=dense.lookups,
                           output_head=dense.output_head,
                           uneven_blocks=(s.n_layers - s.n_moe_layers) * (dense.per_block - block))


def parameter_tensors(s: ModelShape) -> int:
    # As Llama's, plus the query/key norms; an MoE block's router, two stacked expert tensors
    # and the shared experts' three in place of w1 w2 w3.
    moe = s.n_moe_layers
    per_block = 6 + (2 if s.qk_norm else 0)
    return (2 + (0 if s.tied_output else 1) + per_block * s.n_layers + 3 * (s.n_layers - moe)
            + moe * (3 + (3 if s.n_shared_experts else 0)))


def local_parameters(s: ModelShape, tp: int, ep: int = 1) -> LocalParameters:
    """No tensor parallel of the experts: the blocks averaged, as the planner runs them alike,
    and under expert parallel (``ep``) the routed experts apart, ``1/ep`` of them per rank."""
    groups = parameter_groups(s)
    d = s.dim
    blocks = groups.blocks * groups.per_block + groups.uneven_blocks
    routed = s.routed_expert_parameters
    dense_blocks = blocks - routed if ep > 1 else blocks
    head = d + (0 if s.tied_output else groups.output_projection)
    return LocalParameters(
        embedding=groups.embedding, per_block=dense_blocks / s.n_layers, head=head, blocks=s.n_layers,
        matmul_embedding=groups.embedding if s.tied_output else 0.0, matmul_head=head,
        experts=routed / ep if ep > 1 else 0.0,
        active_per_block=(blocks - s.inactive_expert_parameters) / s.n_layers,
    )


def parameter_counts(config: MoEConfig) -> tuple[int, int]:
    """(total, active) parameters of the model ``config`` builds: active are those a token
    uses, its top-k of each layer's routed experts instead of all of them (tied weights once)."""
    s = shape(config)
    total = parameter_groups(s).total
    return total, total - s.inactive_expert_parameters


def describe(config: MoEConfig) -> str:
    """Llama's positions, then the mixture of experts: experts, top-k, router, balancing, and the
    parameters a token uses against those the model holds."""
    total, active = parameter_counts(config)
    layers = ("every layer" if config.moe_every == 1
              else f"one layer in {config.moe_every} ({config.n_moe_layers} of {config.n_layers})")
    shared = f" + {config.n_shared_experts} shared" if config.n_shared_experts else ""
    balance = [f"aux loss x {config.aux_loss_coef:g}"] if config.aux_loss_coef else []
    balance += [f"bias update {config.bias_update_rate:g}"] if config.bias_update_rate else []
    return (f"{llama_sizes.describe(config)}; mixture of experts in {layers}: {config.n_experts} experts{shared} of "
            f"FFN {config.expert_ffn_dim}, top-{config.top_k} {config.router} router, dropless, balancing: "
            f"{', '.join(balance) or 'none'}; {active:,} active of {total:,} parameters per token")


SIZES = FamilySizes(shape=shape, parameter_groups=parameter_groups, parameter_tensors=parameter_tensors,
                    local_parameters=local_parameters, output_split_by_tp=True, describe=describe)
