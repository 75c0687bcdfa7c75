"""RoBERTa's configuration (torch-free: the command line reads it before torch is imported)."""

from __future__ import annotations

from dataclasses import dataclass

from distlm.errors import UsageError


@dataclass
class RobertaConfig:
    dim: int = 768
    """Hidden size of every encoder layer."""
    n_layers: int = 12
    """Number of encoder layers."""
    n_heads: int = 12
    """Attention heads per layer; must divide ``dim``."""
    ffn_dim: int = 3072
    """Inner size of the feed-forward block."""
    max_positions: int = 512
    """Longest sample in tokens; sizes the learned positional table."""
    dropout: float = 0.1
    """Dropout on embeddings, attention output and feed-forward output."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    activation_dropout: float = 0.0
    """Dropout after the feed-forward activation (fairseq's --activation-dropout)."""
    layer_norm_eps: float = 1e-5
    """Epsilon of every LayerNorm."""
    vocab_size: int = 0
    """Vocabulary size: a published arch's own, else (0) set from the data at build time."""
    padding_idx: int = 1
    """Token id of padding; its embedding row stays zero and it is masked out of attention."""

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "max_positions", "vocab_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must be positive")
        if self.dim % self.n_heads != 0:
            raise UsageError(f"model setting n_heads={self.n_heads} must divide dim={self.dim}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must be in [0, 1)")
        if not 0 <= self.padding_idx < self.vocab_size:
            raise UsageError(
                f"padding_idx={self.padding_idx} is outside the vocabulary of size "
                f"{self.vocab_size}; check the dictionary's pad symbol"
            )


# fairseq's roberta.base / Hugging Face's roberta-base use GPT-2's BPE (50265 symbols).
ARCHS: dict[str, RobertaConfig] = {
    # Small enough (~1.8M parameters without the embedding) to train on one CPU core.
    "roberta_tiny": RobertaConfig(dim=192, n_layers=4, n_heads=4, ffn_dim=768, max_positions=512),
    "roberta_base": RobertaConfig(dim=768, n_layers=12, n_heads=12, ffn_dim=3072, max_positions=512,
                                  vocab_size=50265),
    "roberta_large": RobertaConfig(dim=1024, n_layers=24, n_heads=16, ffn_dim=4096, max_positions=512,
                                   vocab_size=50265),
}
"""Published arch -> config; the tiny arch takes its vocabulary from the data (``vocab_size`` 0)."""
