"""Llama's configuration (torch-free: the command line reads it before torch is imported)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from distlm.errors import UsageError

# Rotary frequency scalings distlm implements (Hugging Face's rope_type names).
ROPE_TYPES = ("default", "llama3")


@dataclass
class LlamaConfig:
    dim: int = 4096
    """Hidden size of every block."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads per block; must divide ``dim`` unless ``head_size`` is set."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means ``n_heads`` (plain multi-head)."""
    head_size: int | None = None
    """Size of each attention head (Hugging Face's ``head_dim``); None means ``dim // n_heads``."""
    ffn_dim: int | None = None
    """Feed-forward hidden size (Hugging Face's ``intermediate_size``); None derives it from
    ``multiple_of`` and ``ffn_dim_multiplier`` as Meta's reference code does."""
    multiple_of: int = 256
    """The derived feed-forward hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the derived feed-forward hidden size before rounding (Llama 3 uses 1.3)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    rope_type: str = "default"
    """Rotary frequency scaling: ``"default"`` (none) or ``"llama3"`` (Llama 3.1's, set by the
    four ``rope_*`` fields below, which ``"default"`` ignores)."""
    rope_factor: float = 8.0
    """llama3 scaling: low frequencies are divided by this."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_max_seq_len / this are fully scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_max_seq_len / this are left alone."""
    rope_original_max_seq_len: int = 8192
    """llama3 scaling: the context length of pretraining before the extension."""
    tie_word_embeddings: bool = False
    """The output projection is the token embedding matrix (one parameter, not a copy)."""
    max_seq_len: int = 2048
    """Longest sample in tokens; sizes the rotary tables."""
    dropout: float = 0.0
    """Dropout on the attention and feed-forward outputs before each residual add."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    vocab_size: int = 0
    """Vocabulary size: a published arch's own, else (0) set from the data at build time."""
    padding_idx: int = 1
    """Padding token id. Only recorded: causal attention needs no padding mask because
    the loss ignores padded targets."""

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads if self.head_size is None else self.head_size

    @property
    def ffn_hidden_dim(self) -> int:
        """``ffn_dim`` when given, else the SwiGLU hidden size of Meta's reference: 2/3 of
        4*dim (three matrices instead of two keep the FLOPs of a 4*dim MLP), scaled, then
        rounded up."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def llama3_scaling(self) -> tuple[float, float, float, int] | None:
        """The arguments of ``llama3_scaled_frequencies`` when rope_type is llama3, else None."""
        if self.rope_type != "llama3":
            return None
        return self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_seq_len

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "kv_heads", "multiple_of", "max_seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must be positive")
        for name in ("head_size", "ffn_dim"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must be positive (or None)")
        if self.head_size is None and self.dim % self.n_heads != 0:
            raise UsageError(f"model setting n_heads={self.n_heads} must divide dim={self.dim}")
        if self.head_dim % 2 != 0:
            shown = "head_size" if self.head_size is not None else "head size dim/n_heads"
            raise UsageError(f"{shown}={self.head_dim} must be even for rotary embeddings")
        if self.rope_type not in ROPE_TYPES:
            raise UsageError(
                f"model setting rope_type={self.rope_type!r} is unknown; choose one of: {', '.join(ROPE_TYPES)}"
            )
        if self.rope_type == "llama3":
            for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"):
                if getattr(self, name) <= 0:
                    raise UsageError(f"model setting {name}={getattr(self, name)} must be positive")
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                raise UsageError(
                    f"model setting rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                    f"rope_low_freq_factor={self.rope_low_freq_factor}"
                )
        if self.n_heads % self.kv_heads != 0:
            raise UsageError(
                f"model setting n_kv_heads={self.kv_heads} must divide n_heads={self.n_heads}"
            )
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must be in [0, 1)")


_LLAMA3_8B = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3,
                         rope_theta=500000.0, max_seq_len=8192, vocab_size=128256)

ARCHS: dict[str, LlamaConfig] = {
    "llama_tiny": LlamaConfig(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, multiple_of=64, max_seq_len=2048),
    # The feed-forward sizes come from Meta's params.json (multiple_of, ffn_dim_multiplier):
    # 11008 for Llama 2 7B and 14336 for Llama 3 8B, Hugging Face's intermediate_size.
    "llama2_7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, multiple_of=256, max_seq_len=4096, vocab_size=32000),
    "llama3_8b": _LLAMA3_8B,
    # Llama 3 8B's weights layout with the 128K context of Llama 3.1 (llama3 rope scaling).
    "llama3_1_8b": dataclasses.replace(_LLAMA3_8B, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                                       rope_high_freq_factor=4.0, rope_original_max_seq_len=8192, max_seq_len=131072),
}
"""Published arch -> config; the tiny arch takes its vocabulary from the data (``vocab_size`` 0)."""
