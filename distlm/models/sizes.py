"""The sizes every count of distlm is built from, whatever the family: a model's shape, its
parameters by role, and the share one tensor-parallel rank holds. Each family computes them
from its config (its ``FamilySizes``); FLOPs, memory and the planner read only these.
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The sizes that fix a transformer's parameters and FLOPs, laid out as distlm builds it."""

    family: str
    """The name of the family whose formulas count this shape (``distlm.models.registry``)."""
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_positions: int
    padding_idx: int = 1
    """Sizes only a learned position table with fairseq's offset (RoBERTa's: ``max_positions +
    padding_idx + 1`` rows); a family without one leaves it at 1, whatever its padding id."""
    tied_output: bool = False
    """Whether the output projection is the token embedding (always for RoBERTa)."""
    n_experts: int = 0
    """A mixture of experts: routed experts per MoE layer (0: a dense model)."""
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

    @property
    def routed_expert_parameters(self) -> int:
        """Parameters of the routed experts of every MoE layer (0 for a dense model)."""
        return self.n_moe_layers * self.n_experts * 3 * self.dim * self.moe_ffn_dim


@dataclass(frozen=True)
class ParameterGroups:
    """Parameter counts by role, the pieces every estimate is built from."""

    embedding: int
    """Lookup tables (token, and RoBERTa's positions); the tied output projection counts here once."""
    per_block: int
    """One transformer block."""
    head: int
    """After the blocks: final norm, untied output projection, RoBERTa's LM-head dense/norm/bias."""
    output_projection: int
    """Parameters of the vocabulary projection (shared with ``embedding`` when tied)."""
    blocks: int
    lookups: int
    """Parameters that do no matrix multiply: the lookup tables, less a tied output projection
    (which multiplies like any weight although its storage is the embedding's)."""
    output_head: int
    """Parameters a token multiplies only where the model computes its output: the output
    projection, and whatever runs before it there only (RoBERTa's LM head)."""
    uneven_blocks: int = 0
    """Parameters the blocks hold beyond ``blocks x per_block``: a mixture of experts whose
    MoE blocks (``per_block``) alternate with smaller dense ones has a negative amount here."""

    @property
    def total(self) -> int:
        return self.embedding + self.blocks * self.per_block + self.uneven_blocks + self.head


@dataclass(frozen=True)
class LocalParameters:
    """Parameters one tensor-parallel rank holds, by role (see ``ParameterGroups``)."""

    embedding: float
    per_block: float
    head: float
    blocks: int
    matmul_embedding: float
    """Of ``embedding``, the part that multiplies per token (a tied output projection)."""
    matmul_head: float
    experts: float = 0.0
    """Routed expert parameters expert parallel holds on this rank, outside the dense
    strategy (its share of every MoE layer's experts); 0 without expert parallel, where
    they are in ``per_block``."""
    active_per_block: float | None = None
    """Of a mixture of experts, the parameters a token multiplies in an average block (its
    top-k experts, not all of them); None: ``per_block``."""

    @property
    def dense_total(self) -> float:
        """Parameters the data-parallel strategy holds (shards or replicates)."""
        return self.embedding + self.blocks * self.per_block + self.head

    @property
    def total(self) -> float:
        return self.dense_total + self.experts

    @property
    def compute_per_block(self) -> float:
        return self.per_block if self.active_per_block is None else self.active_per_block
