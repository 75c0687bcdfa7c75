"""The mixture-of-experts family on one process: routing counted by hand, the auxiliary loss and
its gradient, the bias update, the grouped GEMM against the loop, sizes and FLOPs, refusals.

Expert parallelism across real ranks is tests/test_expert_parallel.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from distlm.backends import get_backend
from distlm.config import parse_args
from distlm.launch.cluster_env import ClusterEnv
from distlm.errors import UsageError
from distlm.mesh import ParallelDims
from distlm.models import arch_config, build_model
from distlm.models.flops import count_parameter_tensors, count_parameters, flops_per_token
from distlm.models.hf import adapter_for
from distlm.models.moe.config import MoEConfig
from distlm.models.moe.model import MoEFeedForward, finish_update, moe_layers
from distlm.models.moe.sizes import parameter_counts as moe_parameter_counts
from distlm.parallel.expert import apply_moe
from distlm.training.start_log import describe_shape
from distlm.training.validation import validate

# ------------------------------------------------------------------ a hand-routed layer

E, K = 4, 2
# Each row's router logits are the row itself (the router's weight is the identity), so the
# top-2 experts are its two largest entries: 0 and 1, 0 and 2, 0 and 3, 1 and 2, 0 and 1;
# the last row is padding.
ROWS = [[3.0, 2.0, 0.0, 0.0], [3.0, 0.0, 2.0, 0.0], [3.0, 0.0, 0.0, 2.0], [0.0, 3.0, 2.0, 0.0],
        [3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]]
TOP2 = [(0, 1), (0, 2), (0, 3), (1, 2), (0, 1)]
COEF = 0.1


def hand_layer(router: str = "softmax", bias_update_rate: float = 0.0) -> MoEFeedForward:
    config = MoEConfig(dim=4, n_layers=1, n_heads=1, n_experts=E, top_k=K, moe_ffn_dim=8, router=router,
                       aux_loss_coef=COEF, bias_update_rate=bias_update_rate, vocab_size=8)
    torch.manual_seed(0)
    layer = MoEFeedForward(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(E))
    layer.real_tokens = torch.tensor([True] * 5 + [False])
    return layer.train()


def test_routing_statistics_and_aux_loss_against_a_hand_count():
    layer = hand_layer()
    layer(torch.tensor(ROWS).unsqueeze(0)).sum().backward()
    # Assignments of the 5 real tokens: expert 0 four times, 1 three, 2 two, 3 once.
    counts = [sum(e in pair for pair in TOP2) for e in range(E)]
    assert counts == [4, 3, 2, 1]
    assert layer.tokens_per_expert.tolist() == counts
    # Switch/Mixtral: coef * E * sum_i f_i P_i, f_i the share of the 10 assignments, P_i the
    # mean softmax probability over the real tokens.
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in ROWS[:5]]
    mean_probs = [sum(p[i] for p in probs) / 5 for i in range(E)]
    aux = COEF * E * sum(counts[i] / 10 * mean_probs[i] for i in range(E))
    record = finish_update(layer, applied=True)
    assert record["aux_loss"] == pytest.approx(aux, rel=1e-6)
    assert record["load_imbalance"] == pytest.approx(4 / 2.5)  # max 4 over mean 10 / 4
    assert record["dropped_tokens"] == 0
    assert finish_update(layer, applied=True) == {}  # counted once: the update's statistics were reset


def test_the_aux_loss_gradient_is_that_of_the_formula_times_the_weight():
    layer = hand_layer()
    layer.aux_loss_weight = 3.0
    out = layer(torch.tensor(ROWS).unsqueeze(0))
    out.backward(torch.zeros_like(out))  # the outputs carry no gradient: the router's is the aux loss's alone
    x = torch.tensor(ROWS[:5])
    weight = layer.gate.weight.detach().clone().requires_grad_()
    share = torch.tensor([4, 3, 2, 1]) / 10
    expected_aux = COEF * E * (share * F.linear(x, weight).softmax(-1).mean(0)).sum()
    (3.0 * expected_aux).backward()
    # fp32 sums in another order: rounding of about 1e-7 of the largest element (a missing
    # weight, or the padding row counted, changes them by tens of percent).
    torch.testing.assert_close(layer.gate.weight.grad, weight.grad, rtol=1e-5, atol=1e-6 * float(weight.grad.abs().max()))


@pytest.mark.parametrize("applied", [True, False])
def test_the_aux_loss_free_bias_moves_towards_an_even_load(applied):
    layer = hand_layer("sigmoid", bias_update_rate=0.01)
    layer(torch.tensor(ROWS).unsqueeze(0))
    finish_update(layer, applied)
    # Counts 4, 3, 2, 1 against the mean 2.5: the two busiest experts' bias falls, the others' rises.
    expected = [-0.01, -0.01, 0.01, 0.01] if applied else [0.0] * 4
    torch.testing.assert_close(layer.gate.e_score_correction_bias, torch.tensor(expected))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_grouped_gemm_and_loop_give_the_same_bits(router):
    """torch._grouped_mm against the loop over experts, forward and backward (CPU, fp32)."""
    model = build_model("qwen3_moe_tiny", vocab_size=50, router=router, n_shared_experts=1, aux_loss_coef=0.01)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for grouped in (False, True):
        for layer in moe_layers(model):
            layer.experts.grouped_mm = grouped
        model.zero_grad()
        logits = model(ids)
        logits.pow(2).mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                        finish_update(model, applied=False)))
    (loop_logits, loop_grads, loop_record), (grouped_logits, grouped_grads, grouped_record) = results
    assert torch.equal(loop_logits, grouped_logits)
    assert all(torch.equal(loop_grads[name], grouped_grads[name]) for name in loop_grads)
    assert loop_record == grouped_record


# ------------------------------------------------------------------ sizes and FLOPs


@pytest.mark.parametrize("overrides", [{}, {"moe_every": 2, "n_layers": 3, "n_shared_experts": 2},
                                       {"tie_word_embeddings": True, "qk_norm": False, "router": "sigmoid"}])
def test_parameter_counts_and_active_flops_match_the_built_model(overrides):
    model = build_model("qwen3_moe_tiny", vocab_size=50, **overrides)
    config = model.config
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    assert count_parameter_tensors(model) == len(list(model.parameters()))
    # Active: every matrix a token multiplies, its top-k of each layer's routed experts only.
    active = sum(p.numel() * (config.top_k / config.n_experts if ".experts." in name else 1)
                 for name, p in model.named_parameters() if name != "tok_embeddings.weight" or config.tie_word_embeddings)
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * 32
    assert flops_per_token(model, 32) == pytest.approx(6 * active + attention)
    assert moe_parameter_counts(config)[0] == count_parameters(model)


def test_published_shapes_have_their_published_sizes():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Mixtral 8x7B: 46.7B, 12.9B (their model cards,
    to the 0.1B they print: Qwen's 3.35B active is cut to 3.3, Mistral's 12.88B rounded to 12.9)."""
    for arch, published in (("qwen3_moe_30b_a3b", (30.5, 3.3)), ("mixtral_8x7b", (46.7, 12.9))):
        total, active = moe_parameter_counts(arch_config(arch))
        np.testing.assert_allclose((total / 1e9, active / 1e9), published, atol=0.06)
    line = describe_shape(arch_config("qwen3_moe_30b_a3b"))
    assert "128 experts of FFN 768, top-8 softmax router" in line
    assert f"{active_of('qwen3_moe_30b_a3b'):,} active of {moe_parameter_counts(arch_config('qwen3_moe_30b_a3b'))[0]:,}" in line


def active_of(arch: str) -> int:
    return moe_parameter_counts(arch_config(arch))[1]


def test_a_mixture_of_experts_has_no_llama_export():
    # Its own layout (distlm/models/moe/hf.py), never Llama's, which would drop the experts.
    assert adapter_for(arch_config("qwen3_moe_tiny")).architecture == "Qwen3MoeForCausalLM"


def test_activation_checkpointing_counts_each_token_once():
    """Recomputing a block in backward routes its tokens again: the statistics must count them
    once, and the auxiliary loss must give the same gradients."""
    ids = torch.randint(4, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    ids[1, -5:] = 1  # padding
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = build_model("qwen3_moe_tiny", vocab_size=50, aux_loss_coef=0.01)
        if recompute:
            for index, block in enumerate(model.layers):
                model.layers[index] = checkpoint_wrapper(block)
        model(ids).pow(2).mean().backward()
        layer = moe_layers(model)[0]
        assert layer.micro_batches == 1
        assert layer.tokens_per_expert.sum() == 27 * 2  # real tokens x top-2
        results.append([p.grad for p in model.parameters()])
    assert all(torch.equal(plain, recomputed) for plain, recomputed in zip(*results))


# ------------------------------------------------------------------ refusals before any rendezvous


def env_of(world_size: int) -> ClusterEnv:
    return ClusterEnv(rank=0, world_size=world_size, local_rank=0, local_world_size=world_size, node_rank=0,
                      num_nodes=1, master_addr="127.0.0.1", master_port=None, launcher="explicit")


@pytest.mark.parametrize("world, flags, message", [
    (6, ["--ep-degree", "3"], "--ep-degree 3 does not divide the 8 experts of each MoE layer"),
    (2, ["--ep-degree", "4"], "--ep-degree 4 does not divide the 2 data-parallel ranks"),
    (2, ["--ep-degree", "2", "--arch", "llama_tiny"], "--ep-degree 2 splits the experts of MoE layers, and --arch "
                                                      "llama_tiny has none"),
    (2, ["--ep-degree", "2", "--strategy", "zero1"], "--ep-degree 2 with --strategy zero1 is not offered"),
    (2, ["--ep-degree", "2", "--comm-hook", "fp16"], "are DDP communication hooks, and with --ep-degree 2"),
    (4, ["--ep-degree", "4", "--tp-degree", "2"], "--ep-degree 4 does not divide the 2 data-parallel ranks"),
    (4, ["--ep-degree", "2", "--tp-degree", "2", "--sequence-parallel"],
     "--sequence-parallel with a mixture of experts .* is not offered"),
    (8, ["--ep-degree", "2", "--tp-degree", "2", "--pp-degree", "2"], "with both --tp-degree 2 and --pp-degree 2"),
])
def test_layouts_experts_cannot_take_are_refused_in_one_line(world, flags, message):
    args = ["--arch", "qwen3_moe_tiny", "--device", "cpu", "--tokens-per-sample", "32", *flags]
    with pytest.raises(UsageError, match=message):
        validate(parse_args(args), env_of(world), get_backend("cpu"))


def test_moe_settings_are_checked_with_the_model():
    with pytest.raises(UsageError, match="top_k=9 exceeds n_experts=8"):
        build_model("qwen3_moe_tiny", vocab_size=50, top_k=9)
    with pytest.raises(UsageError, match="--moe-router mixture is not one of: softmax, sigmoid"):
        parse_args(["--arch", "qwen3_moe_tiny", "--moe-router", "mixture"])
    with pytest.raises(UsageError, match="--num-experts belongs to a qwen3_moe model, but --arch llama_tiny"):
        validate(parse_args(["--arch", "llama_tiny", "--num-experts", "4", "--device", "cpu"]), env_of(1),
                 get_backend("cpu"))


def test_the_backend_chooses_the_grouped_gemm_and_the_log_says_why(caplog):
    """torch 2.13 runs torch._grouped_mm on CPU in float32, forward and backward; a compiled
    float32 run gets the loop, since torch.compile traces the kernel in bfloat16 only."""
    model = build_model("qwen3_moe_tiny", vocab_size=50)
    single = ParallelDims(world_size=1)
    with caplog.at_level("INFO", logger="distlm"):
        apply_moe(model, single, torch.device("cpu"), torch.float32)
        assert all(layer.experts.grouped_mm for layer in moe_layers(model))
        apply_moe(model, single, torch.device("cpu"), torch.float32, compiled=True)
        assert not any(layer.experts.grouped_mm for layer in moe_layers(model))
    first, second = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mixture of experts")]
    assert "as one grouped GEMM (torch._grouped_mm runs on cpu in float32, forward and backward)" in first
    assert "in a loop over experts (torch.compile traces torch._grouped_mm" in second
