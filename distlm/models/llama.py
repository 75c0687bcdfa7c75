"""Llama causal language model (Llama 2 / Llama 3 layout, torchtitan-style names).

Pre-RMSNorm blocks, rotary position embeddings, SwiGLU feed-forward, grouped-query
attention and an untied output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlm.errors import UsageError


@dataclass
class LlamaConfig:
    dim: int = 4096
    """Hidden size of every block."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads per block; must divide ``dim``."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means ``n_heads`` (plain multi-head)."""
    multiple_of: int = 256
    """The feed-forward hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the feed-forward hidden size before rounding (Llama 3 uses 1.3)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    max_seq_len: int = 2048
    """Longest sample in tokens; sizes the rotary tables."""
    dropout: float = 0.0
    """Dropout on the attention and feed-forward outputs before each residual add."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    vocab_size: int = 0
    """Vocabulary size; always set from the data, never by the arch."""
    padding_idx: int = 1
    """Padding token id. Only recorded: causal attention needs no padding mask because
    the loss ignores padded targets."""

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size as in Meta's reference: 2/3 of 4*dim (three matrices
        instead of two keep the FLOPs of a 4*dim MLP), scaled, then rounded up."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "kv_heads", "multiple_of", "max_seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must be positive")
        if self.dim % self.n_heads != 0:
            raise UsageError(f"model setting n_heads={self.n_heads} must divide dim={self.dim}")
        if self.head_dim % 2 != 0:
            raise UsageError(
                f"head size dim/n_heads={self.head_dim} must be even for rotary embeddings"
            )
        if self.n_heads % self.kv_heads != 0:
            raise UsageError(
                f"model setting n_kv_heads={self.kv_heads} must divide n_heads={self.n_heads}"
            )
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must be in [0, 1)")


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, each ``[max_seq_len, head_dim // 2]``, in float32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of ``x: [B, T, H, D]`` by their angles.

    Adjacent pairs are Meta's layout (a complex view of the head); Hugging Face's
    checkpoints permute wq/wk to rotate halves instead, so exports must permute too.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # The ratio, not the head counts, is what survives tensor parallelism: each
        # rank holds n_heads/tp query heads and n_kv_heads/tp key/value heads.
        self.n_rep = config.n_heads // config.kv_heads
        self.attention_dropout = config.attention_dropout
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        dropout_p = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            dropout_p=dropout_p, is_causal=True,
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class LlamaFeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.ffn_hidden_dim
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = LlamaAttention(config)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = LlamaFeedForward(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), cos, sin))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class LlamaCausalLM(nn.Module):
    task = "causal_lm"

    # Tensor-parallel split plan, consumed by distlm.parallel (models never import
    # torch.distributed). "*" stands for the layer index.
    # The sequence_* entries matter only with --sequence-parallel: norms run on
    # sequence shards, and attention / feed-forward gather their input once.
    tp_plan: dict[str, str] = {
        "tok_embeddings": "vocab_embedding",
        "layers.*.attention_norm": "sequence_norm",
        "layers.*.attention": "sequence_gather",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "sequence_norm",
        "layers.*.feed_forward": "sequence_gather",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "norm": "sequence_norm",
        "output": "colwise_output",
    }
    # Config fields (or properties) the tensor-parallel degree must divide.
    tp_divisible: tuple[str, ...] = ("n_heads", "kv_heads", "ffn_hidden_dim")

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        target_device = torch.get_default_device()
        # Modules are created on meta and initialised only by init_weights(), so the
        # torch RNG is consumed the same way whether the model is built directly on
        # a device or on meta and materialised later.
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
            self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
            # Non-persistent: derived from the config, so checkpoints need not carry
            # them, and init_weights() recomputes them after meta construction.
            half = config.head_dim // 2
            self.register_buffer(
                "rope_cos", torch.empty(config.max_seq_len, half, dtype=torch.float32), persistent=False
            )
            self.register_buffer(
                "rope_sin", torch.empty(config.max_seq_len, half, dtype=torch.float32), persistent=False
            )
        if target_device.type != "meta":
            self.to_empty(device=target_device)
            self.init_weights()

    @property
    def max_positions(self) -> int:
        return self.config.max_seq_len

    @property
    def padding_idx(self) -> int:
        return self.config.padding_idx

    @property
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks: the unit of FSDP sharding, activation checkpointing and compile."""
        return self.layers

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights; projections that write into the residual stream (wo,
        w2) are scaled down by sqrt(2 * n_layers) so the residual variance does not
        grow with depth (GPT-2's scheme)."""
        config = self.config
        residual_std = 0.02 / (2 * config.n_layers) ** 0.5
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers:
            attention, feed_forward = layer.attention, layer.feed_forward
            for linear in (attention.wq, attention.wk, attention.wv, feed_forward.w1, feed_forward.w3):
                nn.init.normal_(linear.weight, mean=0.0, std=0.02)
            for linear in (attention.wo, feed_forward.w2):
                nn.init.normal_(linear.weight, mean=0.0, std=residual_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, mean=0.0, std=0.02)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]``; position t sees tokens 0..t only."""
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"input has {seq_len} tokens but the model accepts at most "
                f"max_seq_len={self.config.max_seq_len}"
            )
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))
