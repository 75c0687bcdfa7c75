"""RoBERTa masked language model, laid out like fairseq's so its weights map one-to-one.

Post-LayerNorm encoder, learned positions with fairseq's padding offset, and an LM
head whose output projection is tied to the token embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlm.models.contract import TransformerLM
from distlm.models.roberta.config import RobertaConfig


def make_positions(input_ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """fairseq's position ids: real tokens count up from padding_idx + 1, pads keep padding_idx.

    Counting only non-pad tokens makes a token's position independent of how much
    padding surrounds it, so left- and right-padded batches embed alike.
    """
    not_pad = input_ids.ne(padding_idx).long()
    return torch.cumsum(not_pad, dim=1) * not_pad + padding_idx


class RobertaSelfAttention(nn.Module):
    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.n_heads
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.dim, config.dim)
        self.k_proj = nn.Linear(config.dim, config.dim)
        self.v_proj = nn.Linear(config.dim, config.dim)
        self.out_proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads rather than config.n_heads: under tensor parallelism each rank
        # holds only its share of the heads.
        q, k, v = (
            proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        dropout_p = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class RobertaEncoderLayer(nn.Module):
    """Post-LayerNorm block, as in BERT and fairseq's RoBERTa."""

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.self_attn = RobertaSelfAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.dim, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, config.dim)
        self.final_layer_norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.dropout(self.self_attn(x, attn_mask)))
        x = self.final_layer_norm(x + self.dropout(self.fc2(self.activation_dropout(F.gelu(self.fc1(x))))))
        return x


class RobertaLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> projection onto the (tied) token embedding.

    The projection weight is passed in at call time instead of being registered
    here, so the model owns exactly one copy of it: a second registration would be
    split apart by ``to_empty`` and by FSDP, silently untying the weights.
    """

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.dim, config.dim)
        self.layer_norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.empty(config.vocab_size))

    def forward(self, x: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(F.gelu(self.dense(x)))
        return F.linear(x, output_weight, self.bias)


class RobertaMaskedLM(TransformerLM):
    task = "masked_lm"

    # Tensor-parallel split plan, consumed by distlm.parallel (models never import
    # torch.distributed). The embeddings and the LM head stay replicated: the output
    # projection *is* embed_tokens.weight, and the per-module parallel styles would
    # give that one parameter two different layouts.
    # The sequence_* entries matter only with --sequence-parallel: the encoder layers
    # run on sequence shards (split before the first, gathered after the last), their
    # LayerNorms too, and self-attention gathers its input once.
    tp_plan: dict[str, str] = {
        "layers": "sequence_region",
        "layers.*.self_attn": "sequence_gather",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.out_proj": "rowwise",
        "layers.*.self_attn_layer_norm": "sequence_norm",
        "layers.*.fc1": "colwise",
        "layers.*.fc2": "rowwise",
        "layers.*.final_layer_norm": "sequence_norm",
    }
    # Config fields the tensor-parallel degree must divide.
    tp_divisible: tuple[str, ...] = ("n_heads", "ffn_dim")

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        target_device = torch.get_default_device()
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, config.padding_idx)
            self.embed_positions = nn.Embedding(
                config.max_positions + config.padding_idx + 1, config.dim, config.padding_idx
            )
            self.emb_layer_norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
            self.dropout = nn.Dropout(config.dropout)
            self.layers = nn.ModuleList(RobertaEncoderLayer(config) for _ in range(config.n_layers))
            self.lm_head = RobertaLMHead(config)
        self.materialise_unless_meta(target_device)

    @property
    def max_positions(self) -> int:
        return self.config.max_positions

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT initialisation: N(0, 0.02) weights, zero biases and padding rows."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                module.weight[module.padding_idx].zero_()
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.zeros_(self.lm_head.bias)

    def init_buffers(self) -> None:
        """Compute the buffers that derive from the config: RoBERTa has none (its
        positions are a learned table), unlike Llama's rotary tables."""

    def forward(
        self,
        input_ids: torch.Tensor,
        masked_tokens: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
        has_padding: bool | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]``, or ``[n_masked, V]`` at the masked positions only.

        Restricting the LM head to masked positions (about 15% of tokens) saves most
        of the ``B*T*V`` logits memory, as fairseq does. ``masked_tokens`` is fairseq's
        boolean ``[B, T]`` mask; ``masked_positions`` the same positions as flat indices
        into ``B*T`` (row-major), which needs no device synchronisation to select.
        ``has_padding``: whether ``input_ids`` holds padding, when the caller knows (None:
        find out, which waits for the device).
        """
        if has_padding is None:
            has_padding = bool(input_ids.eq(self.config.padding_idx).any())
        x = self.embed(input_ids, has_padding)
        block_args = self.block_args(input_ids, has_padding)
        for layer in self.layers:
            x = layer(x, *block_args)
        if masked_positions is not None:
            x = x.flatten(0, 1).index_select(0, masked_positions)
        elif masked_tokens is not None:
            x = x[masked_tokens]
        return self.head(x)

    # The three parts of forward, which a pipeline stage runs separately (see the model
    # contract). The head projects onto embed_tokens.weight, so both ends hold it.
    embed_modules: tuple[str, ...] = ("embed_tokens", "embed_positions", "emb_layer_norm")
    head_modules: tuple[str, ...] = ("lm_head", "embed_tokens")

    def embed(self, input_ids: torch.Tensor, has_padding: bool | None = None) -> torch.Tensor:
        """The residual stream entering the first block (zero at padding)."""
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_positions:
            raise ValueError(
                f"input has {seq_len} tokens but the model accepts at most "
                f"max_positions={self.config.max_positions}"
            )
        pad = self.config.padding_idx
        padding_mask = input_ids.eq(pad)
        x = self.embed_tokens(input_ids) + self.embed_positions(make_positions(input_ids, pad))
        x = self.dropout(self.emb_layer_norm(x))
        # Packed samples usually have no padding; skipping the mask then lets SDPA use
        # its fused kernels (a mask rules out flash attention on GPU).
        if has_padding if has_padding is not None else padding_mask.any():
            x = x * (~padding_mask).unsqueeze(-1).type_as(x)
        return x

    def block_args(self, input_ids: torch.Tensor, has_padding: bool | None = None) -> tuple[torch.Tensor | None]:
        """What every block takes besides the residual stream: the attention mask (None without padding)."""
        padding_mask = input_ids.eq(self.config.padding_idx)
        if not (has_padding if has_padding is not None else padding_mask.any()):
            return (None,)
        # SDPA's boolean mask means "may attend"; broadcast over heads and queries.
        return ((~padding_mask)[:, None, None, :],)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from the last block's output (of the positions the caller kept)."""
        return self.lm_head(x, self.embed_tokens.weight)
