"""The mixture of experts' configuration: Llama's, with the experts and their router
(torch-free: the command line reads it before torch is imported)."""

from __future__ import annotations

from dataclasses import dataclass

from distlm.choices import MOE_ROUTERS
from distlm.errors import UsageError
from distlm.models.llama.config import LlamaConfig

ROUTERS = MOE_ROUTERS


@dataclass
class MoEConfig(LlamaConfig):
    n_experts: int = 8
    """Routed experts in each MoE layer (Hugging Face's num_experts / num_local_experts)."""
    top_k: int = 2
    """Experts each token is routed to (num_experts_per_tok)."""
    moe_ffn_dim: int | None = None
    """Hidden size of each expert's SwiGLU (moe_intermediate_size); None: the dense ``ffn_hidden_dim``."""
    moe_every: int = 1
    """Block i is an MoE block when (i + 1) is a multiple of this (decoder_sparse_step); the
    others keep Llama's dense feed-forward of ``ffn_hidden_dim``."""
    n_shared_experts: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek-V3: 1), as one
    SwiGLU of ``n_shared_experts * moe_ffn_dim``."""
    router: str = "softmax"
    """``softmax`` (Qwen3-MoE, Mixtral) or ``sigmoid`` (DeepSeek-V3): see ``ROUTERS``."""
    norm_topk_prob: bool = True
    """Divide the chosen experts' weights by their sum (Qwen3-MoE norm_topk_prob; Mixtral always does)."""
    route_scale: float = 1.0
    """The routed experts' weights are multiplied by this (DeepSeek-V3's routed_scaling_factor)."""
    aux_loss_coef: float = 0.0
    """Coefficient of the load-balancing loss (router_aux_loss_coef); 0: none."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each update every expert's selection
    bias moves by this towards an even load (up when under-loaded); 0: never."""
    qk_norm: bool = False
    """RMSNorm each query and key head before the rotary embedding (Qwen3)."""

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim if self.moe_ffn_dim is not None else self.ffn_hidden_dim

    @property
    def uses_expert_bias(self) -> bool:
        """Whether the router holds a selection bias: the sigmoid router's, or the one the
        auxiliary-loss-free balancing moves."""
        return self.router == "sigmoid" or self.bias_update_rate > 0

    def is_moe_layer(self, index: int) -> bool:
        return (index + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(index) for index in range(self.n_layers))

    def validate(self) -> None:
        super().validate()
        for name in ("n_experts", "top_k", "moe_every"):
            if getattr(self, name) <= 0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must be positive")
        if self.top_k > self.n_experts:
            raise UsageError(f"model setting top_k={self.top_k} exceeds n_experts={self.n_experts}; "
                             "a token cannot use more experts than there are")
        if self.moe_ffn_dim is not None and self.moe_ffn_dim <= 0:
            raise UsageError(f"model setting moe_ffn_dim={self.moe_ffn_dim} must be positive (or None)")
        if self.n_moe_layers == 0:
            raise UsageError(f"model setting moe_every={self.moe_every} leaves none of the {self.n_layers} layers "
                             "a mixture of experts; lower it to at most n_layers")
        if self.router not in ROUTERS:
            raise UsageError(f"model setting router={self.router!r} is unknown; choose one of: {', '.join(ROUTERS)}")
        for name in ("n_shared_experts", "aux_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise UsageError(f"model setting {name}={getattr(self, name)} must not be negative")
        if self.route_scale <= 0:
            raise UsageError(f"model setting route_scale={self.route_scale} must be positive")


ARCHS: dict[str, MoEConfig] = {
    # Qwen3-MoE's layout (query/key norms), 8 experts of which each token uses 2, every layer;
    # small enough for a CPU core.
    "qwen3_moe_tiny": MoEConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, n_experts=8, top_k=2,
                                moe_ffn_dim=32, qk_norm=True, max_seq_len=2048),
    # Shapes of the published models, from their config.json (Hugging Face's names in brackets):
    # the experts' hidden size (moe_intermediate_size; Mixtral's intermediate_size), the
    # router's aux-loss coefficient (router_aux_loss_coef).
    "mixtral_8x7b": MoEConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, n_experts=8, top_k=2,
                              moe_ffn_dim=14336, aux_loss_coef=0.02, rope_theta=1e6, max_seq_len=32768,
                              vocab_size=32000),
    "qwen3_moe_30b_a3b": MoEConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_size=128, ffn_dim=6144,
                                   n_experts=128, top_k=8, moe_ffn_dim=768, aux_loss_coef=0.001, qk_norm=True,
                                   norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, vocab_size=151936),
}
"""Published arch -> config (the tiny one takes its vocabulary from the data)."""
