"""Tests for distlm.models: sizes, forward semantics, deterministic init, registry errors."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import distlm.models
from distlm.errors import UsageError
from distlm.models import arch_config, arch_names, build_model, family_of_arch

VOCAB = 260
PAD = 1
TINY = ("roberta_tiny", "llama_tiny")


def count_parameters(model: torch.nn.Module) -> int:
    # parameters() yields each Parameter once, so a tied weight counts once.
    return sum(p.numel() for p in model.parameters())


def build_tiny(arch: str, **overrides) -> torch.nn.Module:
    return build_model(
        arch, vocab_size=VOCAB, padding_idx=PAD, dropout=0.0, attention_dropout=0.0, **overrides
    )


def random_tokens(generator: torch.Generator, batch: int, seq_len: int) -> torch.Tensor:
    # Ids from PAD + 1 upwards, so no accidental padding.
    return torch.randint(PAD + 1, VOCAB, (batch, seq_len), generator=generator)


# ---------------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize("arch", arch_names())
def test_every_arch_builds_on_meta(arch):
    with torch.device("meta"):
        model = build_model(arch, vocab_size=VOCAB)
    assert all(p.is_meta for p in model.parameters())
    assert isinstance(model.layers, torch.nn.ModuleList)
    assert len(model.layers) == model.config.n_layers
    assert model.max_positions > 0
    assert family_of_arch(arch).task.name in ("masked_lm", "causal_lm")


@pytest.mark.parametrize(
    "arch, vocab, published, tolerance",
    [
        ("roberta_large", 50265, 355e6, 0.01),
        ("llama2_7b", 32000, 6.74e9, 0.005),
        ("llama3_8b", 128256, 8.03e9, 0.005),
    ],
)
def test_published_parameter_counts(arch, vocab, published, tolerance):
    with torch.device("meta"):
        model = build_model(arch, vocab_size=vocab)
    assert count_parameters(model) == pytest.approx(published, rel=tolerance)


def test_llama_ffn_hidden_sizes_match_meta_reference():
    assert arch_config("llama2_7b").ffn_hidden_dim == 11008
    assert arch_config("llama3_8b").ffn_hidden_dim == 14336


def test_roberta_tiny_is_small_without_vocabulary():
    model = build_tiny("roberta_tiny")
    vocab_dependent = model.embed_tokens.weight.numel() + model.lm_head.bias.numel()
    assert 1e6 <= count_parameters(model) - vocab_dependent <= 2e6


def test_vocabulary_comes_from_caller():
    for arch in arch_names():
        with torch.device("meta"):
            model = build_model(arch, vocab_size=1234)
        assert model.config.vocab_size == 1234


def test_roberta_lm_head_is_tied_to_token_embedding():
    model = build_tiny("roberta_tiny")
    names = {name for name, _ in model.named_parameters()}
    assert "lm_head.bias" in names and "lm_head.dense.weight" in names
    assert not any(name.startswith("lm_head.weight") for name in names)
    # A change to the embedding must show in the output projection.
    input_ids = random_tokens(torch.Generator().manual_seed(0), 1, 8)
    before = model(input_ids)
    with torch.no_grad():
        model.embed_tokens.weight[5].add_(1.0)
    after = model(input_ids)
    assert not torch.allclose(before[..., 5], after[..., 5])


def test_fairseq_parameter_names():
    roberta = dict(build_tiny("roberta_tiny").named_parameters())
    for name in (
        "embed_tokens.weight",
        "embed_positions.weight",
        "emb_layer_norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.out_proj.bias",
        "layers.0.self_attn_layer_norm.weight",
        "layers.0.fc1.weight",
        "layers.0.fc2.weight",
        "layers.0.final_layer_norm.weight",
        "lm_head.dense.weight",
        "lm_head.layer_norm.weight",
        "lm_head.bias",
    ):
        assert name in roberta, name
    config = arch_config("roberta_tiny")
    assert roberta["embed_positions.weight"].shape[0] == config.max_positions + PAD + 1


# ---------------------------------------------------------------------------------
# Initialisation


def max_abs_difference(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, float]:
    # Buffers included (non-persistent ones are not in the state_dict).
    tensors_a = dict(a.named_parameters()) | dict(a.named_buffers())
    tensors_b = dict(b.named_parameters()) | dict(b.named_buffers())
    assert tensors_a.keys() == tensors_b.keys()
    return {name: (tensors_a[name] - tensors_b[name]).abs().max().item() for name in tensors_a}


@pytest.mark.parametrize("arch", TINY)
def test_meta_then_init_weights_equals_direct_construction(arch):
    torch.manual_seed(1234)
    direct = build_tiny(arch)
    torch.manual_seed(1234)
    with torch.device("meta"):
        deferred = build_tiny(arch)
    deferred.to_empty(device="cpu")
    deferred.init_weights()
    differences = max_abs_difference(direct, deferred)
    assert all(d == 0.0 for d in differences.values()), differences


@pytest.mark.parametrize("arch", TINY)
def test_init_weights_overwrites_every_tensor(arch):
    """Poison every parameter and buffer; init_weights under the same seed must restore all."""
    torch.manual_seed(7)
    model = build_tiny(arch)
    reference = build_tiny(arch)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.fill_(float("nan"))
    torch.manual_seed(7)
    model.init_weights()
    differences = max_abs_difference(model, reference)
    assert all(d == 0.0 for d in differences.values()), differences


@pytest.mark.parametrize(
    "arch, weight",
    [("roberta_tiny", "layers.0.fc1.weight"), ("llama_tiny", "layers.0.feed_forward.w1.weight")],
)
def test_different_seeds_give_different_weights(arch, weight):
    torch.manual_seed(0)
    a = build_tiny(arch)
    torch.manual_seed(1)
    b = build_tiny(arch)
    assert not torch.equal(a.get_parameter(weight), b.get_parameter(weight))


def test_roberta_init_statistics():
    torch.manual_seed(0)
    model = build_model("roberta_base", vocab_size=1000)
    assert model.layers[0].fc1.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert torch.count_nonzero(model.layers[0].fc1.bias) == 0
    assert torch.count_nonzero(model.embed_tokens.weight[PAD]) == 0
    assert torch.count_nonzero(model.embed_positions.weight[PAD]) == 0
    assert torch.count_nonzero(model.lm_head.bias) == 0
    assert torch.all(model.emb_layer_norm.weight == 1)


def test_llama_rotary_tables_recomputed_after_meta():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_tiny("llama_tiny")
    model.to_empty(device="cpu")
    model.init_weights()
    config = model.config
    position, pair = 37, 3
    angle = position * config.rope_theta ** (-2 * pair / config.head_dim)
    assert model.rope_cos[position, pair].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert model.rope_sin[position, pair].item() == pytest.approx(math.sin(angle), abs=1e-6)
    assert "rope_cos" not in model.state_dict()


# ---------------------------------------------------------------------------------
# Forward semantics


@pytest.mark.parametrize("arch", TINY)
def test_forward_shapes(arch):
    model = build_tiny(arch)
    input_ids = random_tokens(torch.Generator().manual_seed(0), 3, 11)
    assert model(input_ids).shape == (3, 11, VOCAB)


def test_roberta_masked_tokens_equal_indexed_full_logits():
    torch.manual_seed(0)
    model = build_tiny("roberta_tiny").eval()
    generator = torch.Generator().manual_seed(1)
    input_ids = random_tokens(generator, 3, 12)
    input_ids[2, 9:] = PAD
    masked_tokens = torch.rand(3, 12, generator=generator) < 0.3
    masked_tokens[0, 0] = True
    full = model(input_ids)
    masked = model(input_ids, masked_tokens=masked_tokens)
    assert masked.shape == (int(masked_tokens.sum()), VOCAB)
    torch.testing.assert_close(masked, full[masked_tokens], rtol=1e-5, atol=1e-5)


def test_roberta_extra_padding_leaves_real_positions_unchanged():
    torch.manual_seed(0)
    model = build_tiny("roberta_tiny").eval()
    generator = torch.Generator().manual_seed(2)
    input_ids = random_tokens(generator, 2, 10)
    input_ids[1, 7:] = PAD
    padded = torch.cat([input_ids, torch.full((2, 5), PAD)], dim=1)
    with torch.no_grad():
        short = model(input_ids)
        long = model(padded)
    real = input_ids.ne(PAD)
    torch.testing.assert_close(long[:, :10][real], short[real], rtol=1e-5, atol=1e-5)


def test_roberta_positions_follow_fairseq_offset():
    from distlm.models.roberta.model import make_positions

    input_ids = torch.tensor([[5, 6, 7, PAD, PAD], [PAD, PAD, 8, 9, 10]])
    expected = torch.tensor([[2, 3, 4, 1, 1], [1, 1, 2, 3, 4]])
    assert torch.equal(make_positions(input_ids, PAD), expected)


def test_llama_is_causal():
    torch.manual_seed(0)
    model = build_tiny("llama_tiny").eval()
    input_ids = random_tokens(torch.Generator().manual_seed(3), 2, 12)
    changed = input_ids.clone()
    changed[:, 8] = torch.where(changed[:, 8] == VOCAB - 1, PAD + 1, changed[:, 8] + 1)
    with torch.no_grad():
        before, after = model(input_ids), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 8:], after[:, 8:], atol=1e-4)


def test_rotary_matches_complex_rotation_and_is_relative():
    from distlm.models.llama.model import apply_rotary, rotary_tables

    head_dim, seq_len, theta = 8, 16, 10000.0
    cos, sin = rotary_tables(head_dim, seq_len, theta)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, seq_len, 3, head_dim, generator=generator)
    # Reference: Meta's formulation, adjacent pairs as complex numbers times e^{i*pos*freq}.
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    expected = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2))) * rotation)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected.flatten(-2).float(), rtol=1e-5, atol=1e-5)
    # q.k after rotation depends only on the distance between positions.
    q = torch.randn(head_dim, generator=generator).expand(1, seq_len, 1, head_dim)
    k = torch.randn(head_dim, generator=generator).expand(1, seq_len, 1, head_dim)
    rq, rk = apply_rotary(q, cos, sin)[0, :, 0], apply_rotary(k, cos, sin)[0, :, 0]
    assert torch.dot(rq[3], rk[1]).item() == pytest.approx(torch.dot(rq[12], rk[10]).item(), abs=1e-4)
    assert torch.dot(rq[3], rk[1]).item() != pytest.approx(torch.dot(rq[3], rk[2]).item(), abs=1e-4)


def test_llama_grouped_query_attention_matches_repeated_heads():
    """GQA with n_kv_heads=2 equals full multi-head attention whose k/v weights repeat
    each kv head n_heads/n_kv_heads times."""
    torch.manual_seed(0)
    gqa = build_tiny("llama_tiny").eval()
    mha = build_tiny("llama_tiny", n_kv_heads=None).eval()
    config = gqa.config
    n_rep = config.n_heads // config.kv_heads
    state = gqa.state_dict()
    for key, value in list(state.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            heads = value.view(config.kv_heads, config.head_dim, config.dim)
            state[key] = heads.repeat_interleave(n_rep, dim=0).reshape(-1, config.dim)
    mha.load_state_dict(state)
    input_ids = random_tokens(torch.Generator().manual_seed(4), 2, 9)
    with torch.no_grad():
        torch.testing.assert_close(gqa(input_ids), mha(input_ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", TINY)
def test_dropout_only_in_training_mode(arch):
    model = build_model(arch, vocab_size=VOCAB, dropout=0.3, attention_dropout=0.3)
    input_ids = random_tokens(torch.Generator().manual_seed(5), 2, 8)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), model(input_ids), rtol=0, atol=0)
        model.train()
        assert not torch.allclose(model(input_ids), model(input_ids))


@pytest.mark.parametrize("arch", TINY)
def test_overfits_a_fixed_batch(arch):
    torch.manual_seed(0)
    model = build_tiny(arch)
    generator = torch.Generator().manual_seed(6)
    input_ids = random_tokens(generator, 4, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    if family_of_arch(arch).task.name == "masked_lm":
        masked_tokens = torch.rand(4, 16, generator=generator) < 0.25
        masked_tokens[:, 0] = True
        corrupted = input_ids.masked_fill(masked_tokens, VOCAB - 1)

        def loss_fn() -> torch.Tensor:
            logits = model(corrupted, masked_tokens=masked_tokens)
            return F.cross_entropy(logits, input_ids[masked_tokens])
    else:

        def loss_fn() -> torch.Tensor:
            logits = model(input_ids[:, :-1])
            return F.cross_entropy(logits.reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))

    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)
    assert losses[-1] < 0.5 * losses[0], losses


def test_too_long_input_is_rejected():
    model = build_tiny("llama_tiny", max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.full((1, 9), 5))
    roberta = build_tiny("roberta_tiny", max_positions=8)
    with pytest.raises(ValueError, match="max_positions=8"):
        roberta(torch.full((1, 9), 5))


# ---------------------------------------------------------------------------------
# Registry and tensor-parallel plan


def test_unknown_arch_is_a_usage_error():
    with pytest.raises(UsageError, match="--arch gpt9 is unknown; choose one of: .*roberta_tiny"):
        build_model("gpt9", vocab_size=VOCAB)
    with pytest.raises(UsageError, match="gpt9"):
        family_of_arch("gpt9").task.name


def test_unknown_or_mistyped_override_is_a_usage_error():
    with pytest.raises(UsageError, match="'n_layer'"):
        build_model("roberta_tiny", vocab_size=VOCAB, n_layer=2)
    with pytest.raises(UsageError, match="max_seq_len"):
        build_model("roberta_tiny", vocab_size=VOCAB, max_seq_len=64)
    with pytest.raises(UsageError, match="n_layers"):
        build_model("llama_tiny", vocab_size=VOCAB, n_layers="two")
    with pytest.raises(UsageError, match="n_heads"):
        build_model("roberta_tiny", vocab_size=VOCAB, n_heads=5)
    with pytest.raises(UsageError, match="padding_idx"):
        build_model("roberta_tiny", vocab_size=VOCAB, padding_idx=VOCAB)


def test_overrides_apply():
    model = build_model("roberta_tiny", vocab_size=VOCAB, n_layers=2, max_positions=64, dropout=0.0)
    assert len(model.layers) == 2
    assert model.max_positions == 64
    assert model.config.dropout == 0.0
    # The registry's config is a template: building with overrides must not change it.
    assert arch_config("roberta_tiny").n_layers == 4


def test_arch_task():
    assert family_of_arch("roberta_base").task.name == "masked_lm"
    assert family_of_arch("llama3_8b").task.name == "causal_lm"




def imported_modules(source: str) -> set[str]:
    """Every module named by an import statement, including `from torch import distributed`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_models_never_import_torch_distributed():
    sources = sorted(Path(distlm.models.__file__).parent.glob("*.py"))
    assert len(sources) >= 3
    assert "torch.distributed.tensor" in imported_modules("from torch.distributed import tensor")
    offenders = {
        path.name: sorted(
            name for name in imported_modules(path.read_text()) if name.startswith("torch.distributed")
        )
        for path in sources
    }
    assert {name: found for name, found in offenders.items() if found} == {}
    # Attribute access such as torch.distributed.get_rank() needs no import statement.
    assert not [path.name for path in sources if "torch.distributed." in path.read_text()]
