"""Llama causal language model (Llama 2 / Llama 3 layout, torchtitan-style names).

Pre-RMSNorm blocks, rotary position embeddings (optionally with Llama 3.1's frequency
scaling), SwiGLU feed-forward, grouped-query attention, and an output projection that is
either its own matrix or the token embedding itself (``tie_word_embeddings``).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from distlm.models.contract import TransformerLM
from distlm.models.llama.config import LlamaConfig


def llama3_scaled_frequencies(
    freqs: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_seq_len: int
) -> torch.Tensor:
    """Llama 3.1's context extension: frequencies whose wavelength exceeds
    ``original_max_seq_len / low_freq_factor`` are divided by ``factor``, those below
    ``original_max_seq_len / high_freq_factor`` are kept, and the band between is
    interpolated (Meta's formula). The tensor operations and their order are those of
    transformers' ``_compute_llama3_parameters``, so the float32 results are identical."""
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float, llama3_scaling: tuple[float, float, float, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, each ``[max_seq_len, head_dim // 2]``, in float32.

    ``llama3_scaling``: (factor, low_freq_factor, high_freq_factor, original_max_seq_len)
    of Llama 3.1's frequency scaling, or None for plain rotary embeddings.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if llama3_scaling is not None:
        freqs = llama3_scaled_frequencies(freqs, *llama3_scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of ``x: [B, T, H, D]`` by their angles,
    ``cos``/``sin`` of ``[T, D/2]`` (positions shared by the batch) or ``[B, T, D/2]`` (each
    row's own positions, as document masking restarts them at each document).

    Adjacent pairs are Meta's layout (a complex view of the head); Hugging Face's
    checkpoints permute wq/wk to rotate halves instead, and distlm.models.llama.hf
    permutes them both ways.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos = cos.unsqueeze(-2)  # broadcast over the heads (and, for [T, D/2], over the batch)
    sin = sin.unsqueeze(-2)
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """Where a document starts in ``document_ids [B, T]``: at each row's first token and
    wherever the id changes along a row. Documents are told apart by these changes, not by
    the ids' values, so ids need not be unique across rows or blocks."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document, ``[B, T]`` (rotary positions restart at 0)."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device)
    return index - torch.where(document_starts(document_ids), index, 0).cummax(dim=1).values


def document_positions_and_mask(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``document_ids [B, T]`` (a document is a run of equal ids along a row): each
    token's position within its document ``[B, T]``, and the boolean attention mask
    ``[B, 1, T, T]`` that lets a token see the earlier tokens of its own document only.

    Every token sees itself, so no row of the mask is empty (SDPA would give NaN for one).
    """
    seq_len = document_ids.shape[1]
    segment = document_starts(document_ids).cumsum(dim=1)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    mask = (segment[:, :, None] == segment[:, None, :]) & causal
    return document_positions(document_ids), mask[:, None]


def document_cu_seqlens(document_ids: torch.Tensor) -> torch.Tensor:
    """The documents of ``document_ids [B, T]`` as varlen attention takes them: the offsets
    of their starts in the ``B x T`` tokens flattened row by row, then ``B x T``, int32
    ``[documents + 1]``. The same documents as :func:`document_positions_and_mask`'s mask
    (a row's end ends its last document). How many there are depends on the data, so on
    CUDA this waits for the ids once per forward (every block reuses the offsets)."""
    starts = torch.nonzero(document_starts(document_ids).flatten()).flatten()
    return torch.cat([starts, starts.new_tensor([document_ids.numel()])]).to(torch.int32)


DOCUMENT_ATTENTION = ("sdpa", "varlen")
"""How attention keeps packed documents apart: SDPA with a block-diagonal causal mask (any
device, O(T^2) memory for the mask), or torch.nn.attention.varlen's flash kernel over the
documents' offsets (CUDA, bf16/fp16: each document attends on its own, no mask)."""


def varlen_unavailable(config: LlamaConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why torch.nn.attention.varlen cannot run ``config``'s attention on ``device`` in
    ``dtype``, or None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA only, and this run is on {device.type}"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if _varlen_causal_argument(varlen_attn) is None:
        return f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal"
    if dtype not in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        return f"its flash kernel computes in bf16 or fp16, and this run computes in {name} (add --bf16)"
    if config.attention_dropout > 0:
        return f"it has no attention dropout, and the model's attention_dropout is {config.attention_dropout}"
    if config.head_dim % 8 or config.head_dim > 256:
        return (f"its flash kernel takes head sizes that are multiples of 8 up to 256, "
                f"and the model's is {config.head_dim}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return f"its flash kernel needs compute capability 8.0 or newer, and this GPU has {major}.{minor}"
    return None


def _varlen_causal_argument(varlen_attn) -> dict | None:
    """The keyword that makes ``varlen_attn`` causal: torch 2.13 takes ``window_size=(-1, 0)``,
    earlier releases took ``is_causal=True``; None if it takes neither."""
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" in parameters:
        return {"window_size": (-1, 0)}
    if "is_causal" in parameters:
        return {"is_causal": True}
    return None


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int) -> torch.Tensor:
    """Causal attention of each document on its own: ``q``, ``k``, ``v`` are ``[tokens, heads,
    head size]`` (the batch's rows one after the other, as many heads each), ``cu_seqlens``
    the documents' offsets (:func:`document_cu_seqlens`), ``max_len`` at least the longest
    document (a bound such as the row length is enough: it sizes the kernel's grid)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **_varlen_causal_argument(varlen_attn))


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: None for plain causal attention; a boolean ``[B, 1, T, T]`` (True: may
        attend) for SDPA; or the int32 offsets of packed documents (``document_cu_seqlens``)
        for varlen attention, each document attending to itself alone."""
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = self.norm_qk(q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Query heads per key/value head, from the shapes: tensor parallelism changes the
        # heads a rank holds, and past the key/value heads also their ratio.
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        if mask is not None and mask.dtype != torch.bool:
            out = varlen_causal_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), mask, seq_len)
            return self.wo(out.reshape(batch, seq_len, -1))
        dropout_p = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys ``[B, T, H, D]`` before the rotary embedding: as they are in Llama;
        a family with per-head query/key norms (Qwen3) overrides this."""
        return q, k


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), cos, sin, mask))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


# How each block splits over tensor-parallel ranks; "*" stands for the layer index.
_BLOCK_TP_PLAN: dict[str, str] = {
    "layers.*.attention_norm": "sequence_norm",
    "layers.*.attention": "sequence_gather",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise_kv",
    "layers.*.attention.wv": "colwise_kv",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "sequence_norm",
    "layers.*.feed_forward": "sequence_gather",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


class LlamaCausalLM(TransformerLM):
    task = "causal_lm"

    # Tensor-parallel split plan, consumed by distlm.parallel (models never import
    # torch.distributed). "*" stands for the layer index.
    # The sequence_* entries matter only with --sequence-parallel: norms run on
    # sequence shards, and attention / feed-forward gather their input once.
    tp_plan: dict[str, str] = {
        "tok_embeddings": "vocab_embedding",
        **_BLOCK_TP_PLAN,
        "norm": "sequence_norm",
        "output": "colwise_output",
    }
    # With tie_word_embeddings the output projection *is* tok_embeddings.weight, and one
    # parameter cannot take both the vocab_embedding and the colwise_output layout. So,
    # as in RoBERTa, the embedding stays replicated and the logits whole (no loss
    # parallel); under sequence parallel the blocks form one sequence region (split
    # before the first, gathered after the last) and the final norm sees the whole
    # sequence. A tied model carries this plan as its instance's tp_plan.
    tied_tp_plan: dict[str, str] = {"layers": "sequence_region", **_BLOCK_TP_PLAN}
    # Config fields (or properties) the tensor-parallel degree must divide.
    tp_divisible: tuple[str, ...] = ("n_heads", "ffn_hidden_dim")
    # The key/value heads of the colwise_kv projections: the degree divides them or is
    # a multiple of them (then each head is replicated over degree / kv_heads ranks).
    tp_kv_heads: str = "kv_heads"

    document_attention: str = "sdpa"
    """How attention keeps packed documents apart (``DOCUMENT_ATTENTION``); set by
    :meth:`use_document_attention`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        if config.tie_word_embeddings:
            self.tp_plan = self.tied_tp_plan
        target_device = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(self.build_block(config, index) for index in range(config.n_layers))
            self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
            # A tied projection is tok_embeddings.weight, passed at call time rather than
            # registered twice: a second registration would be split apart by to_empty
            # and by FSDP, silently untying the weights.
            self.output = None if config.tie_word_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
            # Non-persistent: derived from the config, so checkpoints need not carry
            # them, and init_buffers() computes them after meta construction.
            half = config.head_dim // 2
            self.register_buffer(
                "rope_cos", torch.empty(config.max_seq_len, half, dtype=torch.float32), persistent=False
            )
            self.register_buffer(
                "rope_sin", torch.empty(config.max_seq_len, half, dtype=torch.float32), persistent=False
            )
        self.materialise_unless_meta(target_device)

    def build_block(self, config: LlamaConfig, index: int) -> nn.Module:
        """Block ``index`` of the model, built on the meta device (a family built on Llama's
        blocks, such as mixture-of-experts, overrides this)."""
        return LlamaBlock(config)

    @property
    def max_positions(self) -> int:
        return self.config.max_seq_len

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights; projections that write into the residual stream (wo,
        w2) are scaled down by sqrt(2 * n_layers) so the residual variance does not
        grow with depth (GPT-2's scheme). Also computes the buffers (init_buffers)."""
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
        if self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=0.02)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Compute the rotary tables, which derive from the config and are in no checkpoint.

        Draws nothing from the RNG: call it after loading weights into a materialised
        meta model instead of init_weights().
        """
        config = self.config
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta, config.llama3_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]``; position t sees tokens 0..t only.

        ``document_ids [B, T]`` (packed blocks with document masking): a new document starts
        wherever the id changes along a row; position t then sees only the tokens of its
        own document up to t, and rotary positions restart at 0 at each document.
        """
        x = self.embed(input_ids)
        block_args = self.block_args(input_ids, document_ids)
        for layer in self.layers:
            x = layer(x, *block_args)
        return self.head(x)

    # The three parts of forward, which a pipeline stage runs separately (see the model contract).
    embed_modules: tuple[str, ...] = ("tok_embeddings",)

    @property
    def head_modules(self) -> tuple[str, ...]:
        return ("norm", "tok_embeddings") if self.output is None else ("norm", "output")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream entering the first block."""
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"input has {seq_len} tokens but the model accepts at most "
                f"max_seq_len={self.config.max_seq_len}"
            )
        return self.tok_embeddings(input_ids)

    def block_args(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """What every block takes besides the residual stream: the rotary tables, and with
        ``document_ids`` each row's own rotary angles and its block-diagonal causal mask."""
        seq_len = input_ids.shape[1]
        if document_ids is None:
            return self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        if self.document_attention == "varlen":
            positions = document_positions(document_ids)
            return self.rope_cos[positions], self.rope_sin[positions], document_cu_seqlens(document_ids)
        positions, mask = document_positions_and_mask(document_ids)
        return self.rope_cos[positions], self.rope_sin[positions], mask

    def use_document_attention(self, device: torch.device, dtype: torch.dtype) -> str:
        """Attend within packed documents through torch.nn.attention.varlen where it can run
        on ``device`` computing in ``dtype``, else through SDPA with a mask; the start-up
        log's line saying which, and on CUDA why not varlen."""
        reason = varlen_unavailable(self.config, device, dtype)
        self.document_attention = "sdpa" if reason else "varlen"
        if reason is None:
            return "document masking: attention through torch.nn.attention.varlen (flash attention per document)"
        if device.type == "cuda":
            return f"document masking: attention through SDPA with a block-diagonal mask, not varlen: {reason}"
        return "document masking: attention through SDPA with a block-diagonal mask (varlen attention is CUDA's)"

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from the last block's output."""
        x = self.norm(x)
        if self.output is None:
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x)
