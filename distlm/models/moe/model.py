"""Mixture-of-experts causal language model (Qwen3-MoE / Mixtral layout, DeepSeek-V3's router as an option).

Llama's blocks (distlm/models/llama/model.py: grouped-query attention, rotary embeddings,
RMSNorm) with the feed-forward of every ``moe_every``-th block replaced by a
mixture of ``n_experts`` SwiGLU experts, of which each token uses ``top_k``:

- the router (``gate``) scores every expert: a softmax with the top-k weights
  renormalised (Qwen3-MoE, Mixtral), or a sigmoid whose top-k is chosen with a bias
  added (DeepSeek-V3; the bias is what the auxiliary-loss-free balancing moves);
- routing is dropless: every token reaches all of its top-k experts, however
  unevenly they are loaded, so results never depend on how the tokens are spread
  over ranks;
- optional shared experts every token passes through (DeepSeek-V3);
- load balancing by the auxiliary loss of Switch Transformer / Mixtral
  (``aux_loss_coef``), by the bias update (``bias_update_rate``), or both.

The statistics the balancing uses, and the log reports, are those of the global batch,
as one process training on it would compute them. How: each MoE layer's forward in
training counts, for the micro-batch it sees, the tokens routed to each expert and the
router probabilities summed per expert, over its real tokens only (padding is routed
like any token but not counted, since how much of it a batch holds depends on how the
global batch is split over ranks), then sums them over the data-parallel ranks
with ``reduce_statistics`` (installed from outside by distlm/parallel/expert.py; none
in one process), all in one tensor. Of the auxiliary loss
``coef * E * sum_i f_i * P_i`` (``f_i``: share of the global micro-batch's token
assignments that went to expert ``i``, ``P_i``: mean router probability of expert
``i`` over those tokens) each rank then back-propagates its own tokens' share of
``P_i`` against the global ``f_i``; the shares add up to the global loss. The aux
losses of an update's micro-batches are averaged, as one process with the same
``--update-freq`` averages them. Counts summed over the update give the log's load
imbalance (max over mean tokens per expert, worst layer) and the bias update.

Nothing here imports torch.distributed: how tokens reach experts held by other ranks
(``dispatch``) and how statistics are summed over ranks are installed from outside.
Parameter names follow Hugging Face's Qwen3-MoE where Llama's blocks leave room:
``feed_forward.gate.weight``, ``feed_forward.experts.gate_up_proj`` (each expert's
gate and up projections stacked, ``[E, 2F, D]``) and ``feed_forward.experts.down_proj``
(``[E, D, F]``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from distlm.models.llama.model import LlamaAttention, LlamaBlock, LlamaCausalLM, LlamaFeedForward
from distlm.models.moe.config import MoEConfig


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter that expert parallelism distributed (a DTensor's
    local shard), the tensor itself otherwise; read by duck typing, as models import no distributed code."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class MoEAttention(LlamaAttention):
    """Llama's attention with Qwen3's per-head RMSNorm of queries and keys."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # In float32, as the block's own norms see the float32 residual stream: under autocast the
        # heads arrive in half precision, which RMSNorm's float32 weight cannot fuse with.
        return self.q_norm(q.float()).type_as(q), self.k_norm(k.float()).type_as(k)


class Router(nn.Module):
    """Scores every expert for each token and picks its top-k (``MoEConfig.router``)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.kind, self.top_k = config.router, config.top_k
        self.norm_topk_prob, self.route_scale = config.norm_topk_prob, config.route_scale
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.dim))
        if config.uses_expert_bias:
            # Moved by the balancing, never by the optimizer; saved with the model.
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``x [N, D]``: the chosen experts' weights ``[N, k]`` (float32), their ids
        ``[N, k]``, and every expert's probability ``[N, E]`` (float32; for the sigmoid
        router the scores normalised to sum to 1), which the auxiliary loss averages."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(dim=-1) if self.kind == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        probs = scores if self.kind == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return weights, experts, probs


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts stored as stacked tensors, run on tokens sorted by expert.

    ``grouped_mm``: run all experts as one grouped matrix multiply (``torch._grouped_mm``)
    rather than a loop over experts; the backend decides (distlm/parallel/expert.py), as
    the kernel exists for some devices and dtypes only.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        hidden = config.expert_ffn_dim
        self.gate_up_proj = nn.Parameter(torch.empty(config.n_experts, 2 * hidden, config.dim))
        self.down_proj = nn.Parameter(torch.empty(config.n_experts, config.dim, hidden))
        self.grouped_mm = False

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [M, D]`` sorted by expert, ``counts [E_local]`` rows per local expert -> ``[M, D]``."""
        gate_up, down = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        # Under autocast, compute in its type as a Linear would (torch._grouped_mm is not on
        # autocast's lists); otherwise in the activations' (FSDP's mixed precision casts them).
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
        if self.grouped_mm:
            offsets = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)
        outputs = []
        for expert, rows in enumerate(x.split(counts.tolist())):
            # An expert without tokens still runs on its empty slice when none has any, so the
            # weights stay in the graph (a gradient of zeros, not None).
            if len(rows) or (expert == 0 and len(x) == 0):
                gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
                outputs.append(F.linear(F.silu(gate) * up, down[expert]))
        return torch.cat(outputs)


class _AuxLossGradient(torch.autograd.Function):
    """Passes ``output`` through unchanged; in backward gives ``aux`` the gradient ``weight``,
    so the auxiliary loss joins the objective without travelling with the logits (it reaches
    every MoE layer under any wrapper or pipeline stage)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.aux_dtype = aux.dtype
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


def _recomputing() -> bool:
    """Whether this forward runs inside backward: activation checkpointing recomputing it,
    whose tokens were counted already."""
    return torch._C._current_graph_task_id() != -1


class MoEFeedForward(nn.Module):
    """The mixture-of-experts feed-forward of a block: router, routed experts, shared experts.

    Installed from outside (distlm/parallel/expert.py), each None in one process:
    ``dispatch(x, counts, experts) -> y`` runs the experts on tokens sorted by expert
    wherever the experts live (expert parallelism exchanges them between ranks);
    ``reduce_statistics(tensor)`` sums a tensor over the data-parallel ranks in place.
    ``aux_loss_weight`` is the gradient the auxiliary loss gets per unit (the trainer
    sets it to the weight its cross-entropy gets).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss_coef = config.n_experts, config.top_k, config.aux_loss_coef
        self.bias_update_rate = config.bias_update_rate
        self.gate = Router(config)
        self.experts = GroupedExperts(config)
        shared = config.n_shared_experts * config.expert_ffn_dim
        self.shared_experts = LlamaFeedForward(dataclasses.replace(config, ffn_dim=shared)) if shared else None
        self.dispatch: Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor] | None = None
        self.reduce_statistics: Callable[[torch.Tensor], Any] | None = None
        self.aux_loss_weight = 1.0
        self.real_tokens: torch.Tensor | None = None
        """Which tokens of the coming forward are not padding (boolean, flattened), set by the
        model's forward; None: all are. Kept until the next forward, which activation
        checkpointing's recomputation must see alike."""
        self.reset_statistics()

    def reset_statistics(self) -> None:
        """Forget what the micro-batches since the last update routed."""
        self.routed: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per micro-batch since the last update: the tokens of its global batch routed to each
        expert and its auxiliary loss, coefficient included (float64). Kept apart so that a
        pipeline can drop the forwards its schedule runs only to infer shapes."""

    @property
    def micro_batches(self) -> int:
        return len(self.routed)

    @property
    def tokens_per_expert(self) -> torch.Tensor | None:
        """Tokens of the global batch routed to each expert since the last update (float64)."""
        return torch.stack([counts for counts, _ in self.routed]).sum(0) if self.routed else None

    @property
    def aux_loss_sum(self) -> torch.Tensor | None:
        """Sum of the micro-batches' auxiliary losses, coefficient included (float64)."""
        return torch.stack([aux for _, aux in self.routed]).sum() if self.routed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, probs = self.gate(x)
        assignments = experts.flatten()
        counts = torch.bincount(assignments, minlength=self.n_experts)
        aux = self._balance(experts, probs) if self.training else None
        # Each token once per chosen expert, sorted by expert (stable: token order kept within one).
        order = assignments.argsort(stable=True)
        routed = x[order // self.top_k]
        if self.dispatch is None:
            out = self.experts(routed, counts)
        else:
            out = self.dispatch(routed, counts, self.experts)
        out = out[order.argsort()].view(len(x), self.top_k, -1)
        y = (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        if aux is not None:
            y = _AuxLossGradient.apply(y, aux, self.aux_loss_weight)
        return y.view(shape)

    def _balance(self, experts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor | None:
        """Global statistics of this micro-batch's real tokens; this rank's share of the
        auxiliary loss (None without one). See the module docstring."""
        real = self.real_tokens
        if real is not None:
            if len(real) != len(probs):
                raise RuntimeError(f"the MoE layer was told which of {len(real)} tokens are padding but routes "
                                   f"{len(probs)}: its input is not the model's batch")
            experts, probs = experts[real], probs[real]
        with torch.no_grad():
            counts = torch.bincount(experts.flatten(), minlength=self.n_experts)
            stats = torch.cat([counts.double(), probs.sum(dim=0).double(), counts.new_tensor([len(probs)]).double()])
            if self.reduce_statistics is not None:
                self.reduce_statistics(stats)
            global_counts, global_probs = stats[:self.n_experts], stats[self.n_experts:-1]
            tokens = stats[-1].clamp(min=1)  # a micro-batch of padding alone
            share = global_counts / (tokens * self.top_k)
            if not _recomputing():
                aux_value = self.aux_loss_coef * self.n_experts * (share * global_probs / tokens).sum()
                self.routed.append((global_counts.clone(), aux_value))
        if self.aux_loss_coef == 0:
            return None
        scale = self.aux_loss_coef * self.n_experts / tokens.float()
        return scale * (share.float() * probs.sum(dim=0)).sum()

    @torch.no_grad()
    def update_bias(self) -> None:
        """The auxiliary-loss-free step: each expert's selection bias moves by the rate
        towards an even load, from the update's global counts (equal on every rank)."""
        if self.bias_update_rate and self.tokens_per_expert is not None:
            counts = self.tokens_per_expert
            bias = self.gate.e_score_correction_bias
            bias += (self.bias_update_rate * torch.sign(counts.mean() - counts)).to(bias.dtype)


class MoEBlock(LlamaBlock):
    """Llama's block, with Qwen3's query/key norms and, every ``moe_every``-th block, the
    mixture of experts in place of the dense feed-forward."""

    def __init__(self, config: MoEConfig, index: int) -> None:
        super().__init__(config)  # on the meta device: the modules replaced below cost nothing
        if config.qk_norm:
            self.attention = MoEAttention(config)
        if config.is_moe_layer(index):
            self.feed_forward = MoEFeedForward(config)


class MoECausalLM(LlamaCausalLM):
    """A Llama causal LM whose feed-forward is a mixture of experts (see the module docstring)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        # Tensor parallel splits Llama's attention and dense feed-forwards and leaves each MoE
        # feed-forward whole on every tensor-parallel rank (distlm/parallel/expert.py says why);
        # Qwen3's query/key norms see the rank's own heads. Entries only for modules the model has.
        dense = any(not config.is_moe_layer(index) for index in range(config.n_layers))
        self.tp_plan = {pattern: style for pattern, style in self.tp_plan.items()
                        if dense or not pattern.startswith("layers.*.feed_forward.")}
        if config.qk_norm:
            self.tp_plan.update({"layers.*.attention.q_norm": "head_norm", "layers.*.attention.k_norm": "head_norm"})
        self.tp_divisible = ("n_heads", "ffn_hidden_dim") if dense else ("n_heads",)

    def build_block(self, config: MoEConfig, index: int) -> nn.Module:
        return MoEBlock(config, index)

    def block_args(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Llama's; the MoE layers learn which tokens are padding (the data's padding id, which
        the trainer counts as no input token either), to leave them out of their statistics.
        Here, not in forward, so that each pipeline stage, which runs this with the ids, sets it."""
        real = input_ids.ne(self.config.padding_idx).flatten()
        for layer in moe_layers(self):
            layer.real_tokens = real
        return super().block_args(input_ids, document_ids)

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights, router included; projections that write into the residual stream
        (wo, the experts' down_proj, the dense and shared w2) scaled down by sqrt(2 * n_layers)
        as Llama's are. Selection biases start at 0. Also computes the rotary tables."""
        config = self.config
        residual_std = 0.02 / (2 * config.n_layers) ** 0.5
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers:
            attention = layer.attention
            for linear in (attention.wq, attention.wk, attention.wv):
                nn.init.normal_(linear.weight, mean=0.0, std=0.02)
            nn.init.normal_(attention.wo.weight, mean=0.0, std=residual_std)
            for norm in (layer.attention_norm, layer.ffn_norm, getattr(attention, "q_norm", None),
                         getattr(attention, "k_norm", None)):
                if norm is not None:
                    norm.reset_parameters()
            feed_forward = layer.feed_forward
            dense = [feed_forward] if isinstance(feed_forward, LlamaFeedForward) else []
            if isinstance(feed_forward, MoEFeedForward):
                nn.init.normal_(feed_forward.gate.weight, mean=0.0, std=0.02)
                if feed_forward.gate.e_score_correction_bias is not None:
                    feed_forward.gate.e_score_correction_bias.zero_()
                nn.init.normal_(feed_forward.experts.gate_up_proj, mean=0.0, std=0.02)
                nn.init.normal_(feed_forward.experts.down_proj, mean=0.0, std=residual_std)
                dense += [feed_forward.shared_experts] if feed_forward.shared_experts is not None else []
            for mlp in dense:
                nn.init.normal_(mlp.w1.weight, mean=0.0, std=0.02)
                nn.init.normal_(mlp.w3.weight, mean=0.0, std=0.02)
                nn.init.normal_(mlp.w2.weight, mean=0.0, std=residual_std)
        self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=0.02)
        self.init_buffers()


# --------------------------------------------------------------------- counting


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE feed-forwards of ``model`` in order, whatever wraps it; [] for a dense model."""
    return [module for module in model.modules() if isinstance(module, MoEFeedForward)]


def set_aux_loss_weight(model: nn.Module, weight: float) -> None:
    """The gradient the auxiliary loss of each MoE layer gets per unit in the coming
    backward passes: the weight the trainer gives the mean cross-entropy (loss scale,
    data-parallel average and micro-batch average included)."""
    for layer in moe_layers(model):
        layer.aux_loss_weight = weight


def finish_update(model: nn.Module, applied: bool) -> dict[str, Any]:
    """After an update: what its micro-batches routed, for the train line, and (when the
    update applied) the auxiliary-loss-free bias step; {} for a dense model.

    ``aux_loss``: the auxiliary losses of the MoE layers, summed over layers and averaged
    over micro-batches (what the objective added, coefficient included);
    ``load_imbalance``: the worst MoE layer's max over mean tokens per expert (1: even);
    ``dropped_tokens``: tokens that did not reach all their experts (0: routing is dropless).
    """
    layers = [layer for layer in moe_layers(model) if layer.micro_batches]
    if not layers:
        return {}
    if applied:
        for layer in layers:
            layer.update_bias()
    aux = sum(layer.aux_loss_sum / layer.micro_batches for layer in layers)
    imbalance = torch.stack([layer.tokens_per_expert.max() / layer.tokens_per_expert.mean().clamp(min=1e-30)
                             for layer in layers]).max()
    aux_value, imbalance_value = torch.stack([aux, imbalance]).tolist()
    for layer in layers:
        layer.reset_statistics()
    return {"aux_loss": aux_value, "load_imbalance": imbalance_value, "dropped_tokens": 0}


