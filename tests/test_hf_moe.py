"""Hugging Face in and out for the mixture-of-experts family (distlm.models.moe.hf): Qwen3-MoE
and Mixtral configs, weights and logits against transformers itself.

As in test_hf_models.py, small random transformers models with every weight perturbed (the
query/key norms and each expert included) go through save_pretrained, distlm's reader,
distlm's model, distlm's writer and back into transformers' from_pretrained.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from distributed import Scenarios
from distlm.training.builder import resolve_model_spec
from distlm.checkpoint import CheckpointReader
from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.export.cli import main as export_main
from distlm.models import arch_config, build_model
from distlm.models.hf import (
    SpecialTokens,
    adapter_for,
    config_from_hf,
    hf_tensor_specs,
    load_hf_model,
    save_hf_model,
    tensor_loader,
)
from distlm.models.moe import hf as hf_moe
from distlm.models.hf.io import SafetensorsWeights
from distlm.models import registry
from test_hf_models import assert_same_state, llama_ids, perturbed, round_trip
from test_hf_training import hf_args, initial_parameters, train_and_save

# Grouped-query attention with a head_dim that is not hidden/heads (64/4 = 16), 6 experts of
# which 2 per token, and decoder_sparse_step 2: layers 0 and 2 dense (intermediate_size),
# layer 1 a mixture (moe_intermediate_size), so both kinds of feed-forward are mapped.
QWEN3_MOE_SETTINGS = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
    decoder_sparse_step=2, norm_topk_prob=True, max_position_embeddings=256, rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0},
)
MIXTRAL_SETTINGS = dict(
    vocab_size=100, hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256,
)

# The published config.json files (Hugging Face model cards), as transformers 4.x wrote them.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    torch.manual_seed(0)
    original = perturbed(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE_SETTINGS)), seed=7)
    # Shards in and out: the source is read through its index, and the export is sharded.
    return round_trip(tmp_path_factory.mktemp("qwen3_moe"), original, transformers.AutoModelForCausalLM,
                      max_shard_size="60KB")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    torch.manual_seed(0)
    original = perturbed(transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL_SETTINGS)), seed=8)
    return round_trip(tmp_path_factory.mktemp("mixtral"), original, transformers.AutoModelForCausalLM)


FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_and_the_round_trip_is_exact(family, request):
    trip = request.getfixturevalue(family)
    assert_same_state(trip.original, trip.reloaded)
    assert type(trip.reloaded).__name__ == type(trip.original).__name__
    input_ids = llama_ids()
    with torch.no_grad():
        expected = trip.original(input_ids).logits
        torch.testing.assert_close(trip.model(input_ids), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(trip.reloaded(input_ids).logits, expected, rtol=0, atol=1e-5)


def test_qwen3_moe_config_reads_and_writes_its_experts(qwen3_moe):
    config = qwen3_moe.model.config
    assert (config.n_experts, config.top_k, config.moe_ffn_dim, config.moe_every, config.ffn_dim) == (6, 2, 40, 2, 96)
    assert config.qk_norm and config.norm_topk_prob and config.head_dim == 24 and config.rope_theta == 500000.0
    assert [type(layer.feed_forward).__name__ for layer in qwen3_moe.model.layers] == [
        "LlamaFeedForward", "MoEFeedForward", "LlamaFeedForward"]
    written = json.loads((qwen3_moe.out / "config.json").read_text())
    assert (written["num_experts"], written["decoder_sparse_step"], written["mlp_only_layers"]) == (6, 2, [])
    reloaded = qwen3_moe.reloaded.config
    assert (reloaded.num_experts, reloaded.moe_intermediate_size, reloaded.intermediate_size) == (6, 40, 96)


def test_mixtral_config_reads_and_writes_its_experts(mixtral):
    config = mixtral.model.config
    assert (config.n_experts, config.top_k, config.moe_ffn_dim, config.moe_every) == (6, 2, 40, 1)
    assert not config.qk_norm and config.norm_topk_prob and config.rope_theta == 1e6  # MixtralConfig's default theta
    assert adapter_for(config).architecture == "MixtralForCausalLM"
    assert adapter_for(dataclasses.replace(config, qk_norm=True)).architecture == "Qwen3MoeForCausalLM"
    with safe_open(str(mixtral.out / "model.safetensors"), "pt") as exported:
        names = set(exported.keys())
    assert {f"model.layers.1.block_sparse_moe.experts.5.{w}.weight" for w in ("w1", "w2", "w3")} <= names
    assert names == set(safe_open(str(mixtral.source / "model.safetensors"), "pt").keys())


def test_query_key_norms_take_the_rotary_permutation(qwen3_moe):
    """The norm weights are indexed like a head's rows: distlm's are Hugging Face's permuted
    from halves to adjacent pairs (unpermuted, the logits test above fails)."""
    hf = qwen3_moe.original.model.layers[0].self_attn.q_norm.weight
    distlm = qwen3_moe.model.layers[0].attention.q_norm.weight
    assert not torch.equal(distlm, hf)
    half = len(hf) // 2
    assert torch.equal(distlm[0::2], hf[:half]) and torch.equal(distlm[1::2], hf[half:])


def expert_regions(shape: torch.Size) -> list[tuple[slice, ...]]:
    """Blocks as ranks hold them: the experts in halves (expert parallel 2) or uneven thirds,
    each with all rows or a block that crosses gate and up (FSDP's rows of a shard, tensor
    parallel's), and all or half of the columns; and no experts at all."""
    experts, rows, columns = shape
    blocks = [slice(0, experts // 2), slice(experts // 2, experts), slice(0, 1), slice(1, experts - 1)]
    return [(block, row_block, column_block) for block in blocks
            for row_block in (slice(0, rows), slice(rows // 3, rows - 3), slice(2, 2))
            for column_block in (slice(0, columns), slice(0, columns // 2))] + [
        (slice(3, 3), slice(0, rows), slice(0, columns))]


def test_a_rank_reads_only_its_experts_rows_and_columns(qwen3_moe):
    """``tensor_loader``'s regions of the stacked experts equal that region of the whole
    imported tensor, and read from the files exactly that region: only the experts a rank
    holds, and of their gate, up or down tensors only its rows and columns."""
    config = qwen3_moe.model.config
    read: list[str] = []
    sizes: list[int] = []
    with SafetensorsWeights(qwen3_moe.source) as weights:
        original_read = weights.read

        def counted(hf_name, region):
            tensor = original_read(hf_name, region)
            read.append(hf_name)
            sizes.append(tensor.numel())
            return tensor

        weights.read = counted
        load = tensor_loader(qwen3_moe.source, config, weights)
        state = qwen3_moe.model.state_dict()
        for name in ("layers.1.feed_forward.experts.gate_up_proj", "layers.1.feed_forward.experts.down_proj"):
            whole = state[name]
            for region in expert_regions(whole.shape):
                read.clear()
                sizes.clear()
                part = load(name, region)
                assert torch.equal(part, whole[region]), (name, region)
                assert sum(sizes) == part.numel(), (name, region)
                experts = {int(hf_name.split(".")[5]) for hf_name in read}
                assert experts <= set(range(region[0].start, region[0].stop)) or experts == {0}, (name, region)
        read.clear()
        assert torch.equal(load("layers.1.attention.k_norm.weight", (slice(3, 9),)),
                           state["layers.1.attention.k_norm.weight"][3:9])


@pytest.mark.parametrize(
    "base, change, named",
    [
        (QWEN3_30B_A3B, {"architectures": ["Qwen3MoeForSequenceClassification"]},
         "architectures=['Qwen3MoeForSequenceClassification']"),
        (QWEN3_30B_A3B, {"mlp_only_layers": [0, 5]}, "mlp_only_layers=[0, 5]"),
        (QWEN3_30B_A3B, {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=True"),
        (QWEN3_30B_A3B, {"attention_bias": True}, "attention_bias=True"),
        (QWEN3_30B_A3B, {"num_local_experts": 64}, "num_experts=128"),
        (QWEN3_30B_A3B, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
        (MIXTRAL_8X7B, {"sliding_window": 4096}, "sliding_window=4096"),
        (MIXTRAL_8X7B, {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        (MIXTRAL_8X7B, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line_naming_them(base, change, named):
    with pytest.raises(UsageError) as refused:
        config_from_hf({**base, **change})
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"config.json {named}:"), message


@pytest.mark.parametrize(
    "change, named",
    [
        ({"router": "sigmoid"}, "router='sigmoid'"),
        ({"bias_update_rate": 0.001}, "bias_update_rate=0.001"),
        ({"n_shared_experts": 1}, "n_shared_experts=1"),
        ({"route_scale": 2.5}, "route_scale=2.5"),
        ({"qk_norm": False, "moe_every": 2}, "moe_every=2"),
        ({"qk_norm": False, "norm_topk_prob": False}, "norm_topk_prob=False"),
    ],
)
def test_models_transformers_cannot_compute_are_refused_before_anything_is_written(change, named, tmp_path):
    with torch.device("meta"):
        model = build_model("qwen3_moe_tiny", vocab_size=100, **change)
    with pytest.raises(UsageError) as refused:
        save_hf_model(model, tmp_path / "out", SpecialTokens())
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"model setting {named}:"), message
    assert "cannot be exported to Hugging Face" in message
    assert not (tmp_path / "out").exists()


def test_defaults_for_absent_keys_are_transformers_own():
    """A key a config.json omits reads as transformers' class default. Two keys some class
    lacks: Qwen3-MoE's head_dim (its model takes hidden/heads, as None does) and Mixtral's
    attention_bias (its attention never has one)."""
    lacking = {("Qwen3MoeConfig", "head_dim"): None, ("MixtralConfig", "attention_bias"): False}
    for defaults, hf_class in ((hf_moe.QWEN3_MOE_DEFAULTS, transformers.Qwen3MoeConfig),
                               (hf_moe.MIXTRAL_DEFAULTS, transformers.MixtralConfig)):
        for key, value in defaults.items():
            if (hf_class.__name__, key) in lacking:
                assert not hasattr(hf_class, key) and value == lacking[hf_class.__name__, key]
            else:
                assert getattr(hf_class, key) == value, (hf_class.__name__, key)
    assert hf_moe.MIXTRAL.default_theta == transformers.MixtralConfig.default_theta


def resolved(config) -> dict:
    """The settings that decide an MoE model's weights and outputs, whatever fields express them."""
    return dict(
        dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads, kv_heads=config.kv_heads,
        head_dim=config.head_dim, ffn=config.ffn_hidden_dim, norm_eps=config.norm_eps, theta=config.rope_theta,
        scaling=config.llama3_scaling, max_seq_len=config.max_seq_len, vocab=config.vocab_size,
        tied=config.tie_word_embeddings, experts=config.n_experts, top_k=config.top_k, expert_ffn=config.expert_ffn_dim,
        every=config.moe_every, shared=config.n_shared_experts, router=config.router,
        norm_topk=config.norm_topk_prob, qk_norm=config.qk_norm, aux=config.aux_loss_coef,
    )


@pytest.mark.parametrize(
    "arch, published, hf_class, published_count",
    [
        # Mistral AI's and Qwen's model cards: 46.7B and 30.5B parameters.
        ("mixtral_8x7b", MIXTRAL_8X7B, transformers.MixtralForCausalLM, 46_702_792_704),
        ("qwen3_moe_30b_a3b", QWEN3_30B_A3B, transformers.Qwen3MoeForCausalLM, 30_532_122_624),
    ],
)
def test_published_archs_are_the_published_models(arch, published, hf_class, published_count):
    """The built-in arch equals the published config.json read by distlm, has exactly the
    parameters of transformers' model of it, and its export names and shapes are those of
    the published files."""
    assert resolved(config_from_hf(published)[1]) == resolved(arch_config(arch))
    with torch.device("meta"):
        model = build_model(arch)
        reference = hf_class(hf_class.config_class.from_dict(published))
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == published_count
    specs = hf_tensor_specs(model.config, model.state_dict())
    assert sum(spec.numel for spec, _ in specs.values()) == published_count
    qwen = arch == "qwen3_moe_30b_a3b"
    name = ("model.layers.47.mlp.experts.127.down_proj.weight" if qwen
            else "model.layers.31.block_sparse_moe.experts.7.w2.weight")
    assert specs[name][0].shape == ((2048, 768) if qwen else (4096, 14336))


# ---------------------------------------------------------------------- through training

HF_VOCAB = 64  # the data's dictionary (40 words, fairseq's 4 specials) fits
EP2_UPDATES = 2


@pytest.fixture(scope="module")
def ep2_job(data_dir, tmp_path_factory):
    """One 2-rank job: --init-from-hf of a Qwen3-MoE under --ep-degree 2 (the weights each
    rank holds, and what it read), then 2 updates from it and a checkpoint."""
    root = tmp_path_factory.mktemp("ep2_hf")
    torch.manual_seed(0)
    settings = {**QWEN3_MOE_SETTINGS, "vocab_size": HF_VOCAB}
    hf_dir = root / "hf"
    perturbed(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**settings)), seed=9).save_pretrained(hf_dir)
    args = hf_args(data_dir, str(root / "run"), str(hf_dir), "causal_lm") + ["--ep-degree", "2"]
    init_runs = [("ep2", args + ["--no-save"]), ("ep2-fsdp", args + ["--no-save", "--strategy", "fsdp"])]
    scenarios = Scenarios(2, [("init", initial_parameters, (init_runs,)),
                              ("train", train_and_save, ([(args, EP2_UPDATES)],))], timeout=300)
    return hf_dir, root / "run", scenarios


def test_init_from_hf_under_expert_parallel_reads_each_ranks_own_experts(ep2_job):
    """Exact weights on both ranks of EP 2, beside ddp and fsdp. Each rank read from the files
    what it holds: under ddp exactly the dense weights whole and half of each MoE layer's
    experts; under fsdp its shards of the dense weights too (plus the whole heads its rows
    of q/k touch)."""
    hf_dir, _, scenarios = ep2_job
    expected = dict(load_hf_model(hf_dir)[0].named_parameters())
    total = sum(value.numel() for value in expected.values())
    experts = sum(value.numel() for name, value in expected.items() if ".experts." in name)
    for rank in scenarios["init"]:
        for layout in ("ep2", "ep2-fsdp"):
            run = rank[layout]
            assert run["params"].keys() == expected.keys()
            for name, value in expected.items():
                assert torch.equal(run["params"][name], value.detach()), (layout, name)
        assert rank["ep2"]["read"] == rank["ep2"]["held"] == total - experts // 2
        fsdp = rank["ep2-fsdp"]
        assert fsdp["held"] <= fsdp["read"] <= 1.25 * fsdp["held"] and fsdp["held"] < 0.6 * total, fsdp


def test_a_trained_expert_parallel_checkpoint_exports_a_model_transformers_runs(ep2_job):
    """2 updates under EP 2, then ``export --hf``: transformers' Qwen3MoeForCausalLM of the export
    gives the logits of distlm's model of the checkpoint within 1e-5 in fp32 (one rounding
    order against another), and its weights moved away from the Hugging Face ones it started from."""
    hf_dir, save_dir, scenarios = ep2_job
    scenarios["train"]  # fails the test with the training's traceback
    out = save_dir / "exported"
    assert export_main(["--checkpoint", str(save_dir), "--hf", str(out)]) == 0
    reader = CheckpointReader(save_dir)
    assert reader.meta["progress"]["num_updates"] == EP2_UPDATES
    config = registry.family(reader.meta["family"]).config_class(**reader.meta["model_config"])
    model = adapter_for(config).model_class(config)
    model.load_state_dict(dict(reader.model_tensors()), strict=False)  # buffers are derived, not saved
    model.init_buffers()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    name = "model.layers.1.mlp.experts.gate_up_proj"  # transformers stacks the experts in memory
    assert not torch.equal(exported.state_dict()[name], original.state_dict()[name])
    ids = torch.randint(4, HF_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model.eval()(ids), rtol=0, atol=1e-5)


def test_init_from_hf_takes_the_experts_sizes_from_config_json(qwen3_moe, data_dir, tmp_path):
    """A flag that would reshape the experts is refused beside --init-from-hf, as the dense
    sizes are; --arch must agree on them."""
    base = ["--data", data_dir, "--init-from-hf", str(qwen3_moe.source)]
    for flag, field in (("--num-experts", "n_experts"), ("--moe-ffn-dim", "moe_ffn_dim"),
                        ("--moe-shared-experts", "n_shared_experts")):
        with pytest.raises(UsageError, match=f"takes the model's sizes from .* drop the flags that set {field}$"):
            resolve_model_spec(parse_args(base + [flag, "4"]).model)
    spec = resolve_model_spec(parse_args(base).model)
    assert spec.name == "hf_qwen3_moe" and spec.config.n_experts == 6
    # qwen3_moe_tiny's shape but for its 8 experts.
    tiny = hf_moe.config_to_hf(hf_moe.QWEN3_MOE, dataclasses.replace(arch_config("qwen3_moe_tiny"), vocab_size=100),
                               SpecialTokens(), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**tiny, "num_experts": 6}))
    with pytest.raises(UsageError, match="--arch qwen3_moe_tiny has n_experts=8 but --init-from-hf .* has n_experts=6"):
        resolve_model_spec(parse_args(["--data", data_dir, "--init-from-hf", str(tmp_path),
                                       "--arch", "qwen3_moe_tiny"]).model)
