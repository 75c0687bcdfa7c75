"""Hugging Face in and out (distlm.models.hf): configs, weights and logits against transformers itself.

Small random Hugging Face models, every weight perturbed so that no mapping can hide behind
an initial value (ones, zeros, a zero token-type row), go through transformers'
save_pretrained, distlm's reader, distlm's model, distlm's writer and back into
transformers' from_pretrained.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.utils.hub import convert_file_size_to_int

from distlm.errors import UsageError
from distlm.models import arch_config, build_model
from distlm.models.hf import SpecialTokens, config_from_hf, hf_tensor_specs, load_hf_model, save_hf_model, tensor_loader
from distlm.models.llama import hf as hf_llama
from distlm.models.roberta import hf as hf_roberta
from distlm.models.hf.io import SafetensorsWeights, parse_size
from distlm.models.llama.model import llama3_scaled_frequencies, rotary_tables

PAD = 1

# Grouped-query attention, an explicit head_dim that is not hidden/heads (64/4 = 16), an
# intermediate size multiple_of could not give, and llama3 rope scaling whose bands fall
# inside short test sequences (original_max_position_embeddings 64: wavelengths above 64
# are scaled by 1/8, those between 16 and 64 interpolated).
LLAMA_SETTINGS = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)
ROBERTA_SETTINGS = dict(
    vocab_size=100,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=40,
    type_vocab_size=1,
    layer_norm_eps=1e-5,
    pad_token_id=PAD,
)

# The published config.json files (Hugging Face model cards), as transformers 4.x wrote them.
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float16", "use_cache": True, "vocab_size": 32000,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
LLAMA3_1_8B = {
    **LLAMA3_8B,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3",
    },
}
ROBERTA_BASE = {
    "architectures": ["RobertaForMaskedLM"], "attention_probs_dropout_prob": 0.1, "bos_token_id": 0,
    "eos_token_id": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768,
    "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 514,
    "model_type": "roberta", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "type_vocab_size": 1, "vocab_size": 50265,
}
ROBERTA_LARGE = {**ROBERTA_BASE, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                 "num_hidden_layers": 24}


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` in eval mode with N(0, 0.02) noise added to every parameter (norms, biases
    and the token-type row included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model.eval()


@dataclasses.dataclass
class RoundTrip:
    original: torch.nn.Module  # transformers' model
    model: torch.nn.Module  # distlm's, read from original's save_pretrained directory
    reloaded: torch.nn.Module  # transformers' from_pretrained of distlm's export
    source: Path
    out: Path


def round_trip(tmp_path: Path, original: torch.nn.Module, auto_class: type, **save: object) -> RoundTrip:
    source, out = tmp_path / "hf", tmp_path / "out"
    original.save_pretrained(source, **save)
    model, tokens = load_hf_model(source)
    save_hf_model(model, out, tokens, **save)
    reloaded = auto_class.from_pretrained(out)
    return RoundTrip(original, model.eval(), reloaded.eval(), source, out)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> RoundTrip:
    torch.manual_seed(0)
    original = perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_SETTINGS)), seed=1)
    # Shards in and out: the source is read through its index, and the export is sharded.
    return round_trip(
        tmp_path_factory.mktemp("llama"), original, transformers.AutoModelForCausalLM, max_shard_size="50KB"
    )


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> RoundTrip:
    torch.manual_seed(0)
    settings = {**LLAMA_SETTINGS, "head_dim": None, "tie_word_embeddings": True, "rope_parameters": None}
    original = perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)), seed=2)
    return round_trip(tmp_path_factory.mktemp("tied"), original, transformers.AutoModelForCausalLM)


@pytest.fixture(scope="module")
def roberta(tmp_path_factory) -> RoundTrip:
    torch.manual_seed(0)
    original = perturbed(transformers.RobertaForMaskedLM(transformers.RobertaConfig(**ROBERTA_SETTINGS)), seed=3)
    return round_trip(tmp_path_factory.mktemp("roberta"), original, transformers.AutoModelForMaskedLM)


def llama_ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(4))


def roberta_ids() -> torch.Tensor:
    """Real tokens (ids 2..99, never the pad id 1), one row left-padded, one right-padded."""
    ids = torch.randint(2, 100, (3, 14), generator=torch.Generator().manual_seed(5))
    ids[1, :3] = PAD
    ids[2, 9:] = PAD
    return ids


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module, *, except_names: tuple[str, ...] = ()) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    different = [name for name in state_a if name not in except_names and not torch.equal(state_a[name], state_b[name])]
    assert different == []


# ---------------------------------------------------------------------- Llama


def test_llama_round_trip_gives_transformers_identical_weights_and_config(llama):
    assert_same_state(llama.original, llama.reloaded)
    assert llama.reloaded.config.rope_parameters == llama.original.config.rope_parameters
    assert llama.reloaded.config.head_dim == 24
    config = llama.model.config
    assert (config.head_dim, config.kv_heads, config.ffn_hidden_dim, config.rope_type) == (24, 2, 96, "llama3")


def test_llama_logits_match_transformers(llama):
    input_ids = llama_ids()
    with torch.no_grad():
        expected = llama.original(input_ids).logits
        torch.testing.assert_close(llama.model(input_ids), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(llama.reloaded(input_ids).logits, expected, rtol=0, atol=1e-5)


def test_llama_rotary_permutation_is_needed_and_inverts():
    """Meta's adjacent pairs and Hugging Face's halves differ (per kv head for wk) and the
    two permutations undo each other."""
    weight = torch.randn(2 * 24, 64)
    halves = hf_llama.to_rotate_half(weight, n_heads=2)
    assert not torch.equal(halves, weight)
    # Row 2j + c of a head becomes row c * 12 + j of the same head.
    assert torch.equal(halves[24 + 12 + 5], weight[24 + 2 * 5 + 1])
    assert torch.equal(hf_llama.to_adjacent_pairs(halves, n_heads=2), weight)


def test_llama3_rope_scaling_is_transformers_own():
    """distlm's llama3 frequencies equal transformers' _compute_llama3_parameters bit for bit,
    and the rotary tables its LlamaRotaryEmbedding, out to Llama 3.1's last position."""
    hf_config = transformers.LlamaConfig.from_dict(LLAMA3_1_8B)
    config, _ = hf_llama.config_from_hf(LLAMA3_1_8B)
    hf_frequencies, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    assert attention_factor == 1.0
    plain = 1.0 / config.rope_theta ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    frequencies = llama3_scaled_frequencies(plain, *config.llama3_scaling)
    assert torch.equal(frequencies, hf_frequencies)
    assert not torch.equal(frequencies, plain)

    positions = torch.tensor([[0, 1, 77, 8191, 8192, 40000, 131071]])
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta, config.llama3_scaling)
    # Hugging Face repeats the 64 angles for its two halves.
    torch.testing.assert_close(hf_cos[0], torch.cat([cos[positions[0]]] * 2, dim=-1), rtol=0, atol=2e-6)
    torch.testing.assert_close(hf_sin[0], torch.cat([sin[positions[0]]] * 2, dim=-1), rtol=0, atol=2e-6)


def test_generation_config_carries_the_special_tokens(llama):
    written = json.loads((llama.out / "generation_config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
    generation = transformers.GenerationConfig.from_pretrained(llama.out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, None)


# ---------------------------------------------------------------------- tied Llama


def test_tied_llama_round_trip(tied_llama):
    model = tied_llama.model
    assert model.config.tie_word_embeddings and model.output is None
    assert "output.weight" not in model.state_dict()
    with safe_open(str(tied_llama.out / "model.safetensors"), "pt") as exported:
        assert "lm_head.weight" not in exported.keys()
    reloaded = tied_llama.reloaded
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert_same_state(tied_llama.original, reloaded)
    input_ids = llama_ids()
    with torch.no_grad():
        expected = tied_llama.original(input_ids).logits
        torch.testing.assert_close(model(input_ids), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(reloaded(input_ids).logits, expected, rtol=0, atol=1e-5)


def test_tied_llama_stays_tied_through_meta_materialisation():
    with torch.device("meta"):
        tied = build_model("llama_tiny", vocab_size=260, tie_word_embeddings=True)
        untied = build_model("llama_tiny", vocab_size=260)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 260 * tied.config.dim
    tied.to_empty(device="cpu")
    torch.manual_seed(0)
    tied.init_weights()
    input_ids = torch.randint(0, 260, (1, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = tied(input_ids)
        tied.tok_embeddings.weight[7].add_(1.0)
        after = tied(input_ids)
    # Token 7's logit moves at every position, also where token 7 is not in the input.
    assert (before[..., 7] - after[..., 7]).abs().min() > 0


def test_tied_llama_tp_plan_keeps_the_embedding_whole():
    with torch.device("meta"):
        model = build_model("llama_tiny", vocab_size=260, n_layers=2, tie_word_embeddings=True)
    plan = model.tp_plan
    assert plan is not type(model).tp_plan
    assert not {"tok_embeddings", "output", "norm"} & plan.keys()
    assert "colwise_output" not in plan.values()
    kinds = {"colwise": torch.nn.Linear, "colwise_kv": torch.nn.Linear, "rowwise": torch.nn.Linear,
             "sequence_norm": torch.nn.RMSNorm,
             "sequence_region": torch.nn.ModuleList, "sequence_gather": torch.nn.Module}
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        matched = [module for name, module in modules.items() if regex.match(name)]
        assert matched and all(isinstance(m, kinds[style]) for m in matched), pattern


# ---------------------------------------------------------------------- RoBERTa


def test_roberta_round_trip_folds_the_token_type_row(roberta):
    positions = "roberta.embeddings.position_embeddings.weight"
    types = "roberta.embeddings.token_type_embeddings.weight"
    assert_same_state(roberta.original, roberta.reloaded, except_names=(positions, types))
    original, reloaded = roberta.original.state_dict(), roberta.reloaded.state_dict()
    assert original[types].abs().min() > 0  # perturbed: a wrong fold would show
    assert torch.equal(reloaded[types], torch.zeros_like(reloaded[types]))
    torch.testing.assert_close(reloaded[positions] + reloaded[types][0], original[positions] + original[types][0],
                               rtol=0, atol=1e-7)
    assert torch.equal(roberta.model.embed_positions.weight, reloaded[positions])
    # Both tables have fairseq's padding offset: 40 rows = 38 positions + pad + 1.
    assert roberta.model.config.max_positions == 40 - PAD - 1


def test_roberta_logits_match_transformers_at_real_positions(roberta):
    input_ids = roberta_ids()
    real = input_ids.ne(PAD)
    with torch.no_grad():
        expected = roberta.original(input_ids, attention_mask=real.long()).logits
        torch.testing.assert_close(roberta.model(input_ids)[real], expected[real], rtol=0, atol=1e-5)
        # transformers against transformers: every position, padded ones included.
        torch.testing.assert_close(roberta.reloaded(input_ids, attention_mask=real.long()).logits, expected,
                                   rtol=0, atol=1e-5)


def test_roberta_export_is_one_file_and_no_generation_config(roberta):
    names = sorted(path.name for path in roberta.out.iterdir())
    assert names == ["config.json", "model.safetensors"]
    with safe_open(str(roberta.out / "model.safetensors"), "pt") as exported:
        assert "lm_head.bias" in exported.keys()


# ---------------------------------------------------------------------- directory I/O


def test_sharded_export_writes_a_valid_index(llama):
    index = json.loads((llama.out / "model.safetensors.index.json").read_text())
    shards = sorted(path.name for path in llama.out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert sorted(set(index["weight_map"].values())) == shards
    assert shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    total = 0
    for shard in shards:
        with safe_open(str(llama.out / shard), "pt") as file:
            sizes = [file.get_tensor(name).nbytes for name in file.keys()]
            assert {index["weight_map"][name] for name in file.keys()} == {shard}
        # At most 50 KB per shard unless one tensor alone is larger.
        assert sum(sizes) <= 50_000 or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    assert sorted(index["weight_map"]) == sorted(llama.original.state_dict())


def test_reader_serves_the_sharded_source_by_name(llama):
    assert (llama.source / "model.safetensors.index.json").is_file()
    with SafetensorsWeights(llama.source) as weights:
        assert set(weights) == set(llama.original.state_dict())
        name = "model.layers.1.mlp.down_proj.weight"
        assert torch.equal(weights[name], llama.original.state_dict()[name])
        assert torch.equal(weights.get_slice(name)[2:5], weights[name][2:5])


def shard_regions(shape: torch.Size) -> list[tuple[slice, ...]]:
    """Blocks as ranks hold them: uneven thirds of the rows (cutting through attention
    heads), each whole or split into halves of the columns."""
    rows = shape[0]
    cuts = [0, rows // 3 + 1, 2 * rows // 3 + 1, rows]
    row_blocks = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
    if len(shape) == 1:
        return [(block,) for block in row_blocks]
    half = shape[1] // 2
    return [(block, columns) for block in row_blocks
            for columns in (slice(0, shape[1]), slice(0, half), slice(half, shape[1]))]


@pytest.mark.parametrize("family", ["llama", "roberta"])
def test_a_shard_is_read_alone_and_equals_that_part_of_the_whole(family, request):
    """``tensor_loader``'s regions (a rank's shard of each tensor) equal the same region of
    the whole imported tensor, and read from the files only that region, plus the whole
    heads the region's rows touch for Llama's rotary-permuted q/k and RoBERTa's one
    token-type row."""
    trip = request.getfixturevalue(family)
    config = trip.model.config
    read: list[int] = []
    with SafetensorsWeights(trip.source) as weights:
        original_read = weights.read

        def counted(hf_name, region):
            tensor = original_read(hf_name, region)
            read.append(tensor.numel())
            return tensor

        weights.read = counted
        load = tensor_loader(trip.source, config, weights)
        for name, whole in trip.model.state_dict().items():
            for region in shard_regions(whole.shape):
                read.clear()
                part = load(name, region)
                assert torch.equal(part, whole[region]), (name, region)
                columns = part.shape[1] if part.dim() == 2 else 1
                if name.endswith(("attention.wq.weight", "attention.wk.weight")):
                    allowance = 2 * (config.head_dim - 1) * columns  # a partial head at each end
                elif name == "embed_positions.weight":
                    allowance = columns  # the token-type row
                else:
                    allowance = 0
                assert part.numel() <= sum(read) <= part.numel() + allowance, (name, region, read)


@pytest.mark.parametrize("size", ["5GB", "500MB", "10KB", "2GiB", "3MiB", "1KiB", "5Gb", "80kb", 12345])
def test_parse_size_reads_sizes_as_transformers_does(size):
    assert parse_size(size) == convert_file_size_to_int(size)


@pytest.mark.parametrize("size", ["5 TB", "GB", "-1MB", 0])
def test_parse_size_refuses_what_is_not_a_size(size):
    with pytest.raises(UsageError, match="max_shard_size"):
        parse_size(size)


def test_torch_dcp_hf_reader_reads_the_export(llama):
    """torch's HuggingFaceStorageReader (the way to per-rank reads of DTensor shards) reads
    distlm's sharded export as it reads transformers' own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with SafetensorsWeights(llama.out) as weights:
        expected = {name: weights[name] for name in weights}
    state = {name: torch.empty_like(tensor) for name, tensor in expected.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(llama.out)))
    assert all(torch.equal(state[name], expected[name]) for name in expected)


def test_missing_or_misshapen_tensors_are_named(llama, tmp_path):
    config = json.loads((llama.source / "config.json").read_text())
    for name in ("model.safetensors.index.json", *[p.name for p in llama.source.glob("model-*.safetensors")]):
        (tmp_path / name).symlink_to(llama.source / name)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(UsageError, match=r"no tensor model\.layers\.2\.\S+ \(distlm's layers\.2\."):
        load_hf_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(UsageError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \[96, 64\].*\[128, 64\]"):
        load_hf_model(tmp_path)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="no model.safetensors or model.safetensors.index.json"):
        load_hf_model(no_weights)
    with pytest.raises(UsageError, match="config.json: no such file"):
        load_hf_model(tmp_path / "absent")


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "base, change, named",
    [
        (LLAMA3_1_8B, {"model_type": "gpt2"}, "model_type='gpt2'"),
        (LLAMA3_1_8B, {"architectures": ["LlamaForSequenceClassification"]},
         "architectures=['LlamaForSequenceClassification']"),
        (LLAMA3_1_8B, {"attention_bias": True}, "attention_bias=True"),
        (LLAMA3_1_8B, {"mlp_bias": True}, "mlp_bias=True"),
        (LLAMA3_1_8B, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (LLAMA3_1_8B, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
        (LLAMA3_1_8B, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type='dynamic'"),
        (LLAMA3_1_8B, {"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
         "rope_parameters.rope_type='linear'"),
        (LLAMA3_1_8B, {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        (ROBERTA_BASE, {"model_type": "bert"}, "model_type='bert'"),
        (ROBERTA_BASE, {"architectures": ["RobertaModel"]}, "architectures=['RobertaModel']"),
        (ROBERTA_BASE, {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        (ROBERTA_BASE, {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
        (ROBERTA_BASE, {"is_decoder": True}, "is_decoder=True"),
        (ROBERTA_BASE, {"add_cross_attention": True}, "add_cross_attention=True"),
        (ROBERTA_BASE, {"type_vocab_size": 2}, "type_vocab_size=2"),
        (ROBERTA_BASE, {"tie_word_embeddings": False}, "tie_word_embeddings=False"),
        (ROBERTA_BASE, {"pad_token_id": None}, "pad_token_id=None"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line_naming_them(base, change, named):
    with pytest.raises(UsageError) as refused:
        config_from_hf({**base, **change})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"config.json {named}:")


def test_defaults_for_absent_keys_are_transformers_own():
    """A key a config.json omits reads as transformers' class default (position_embedding_type:
    4.x's, a key transformers 5 no longer has)."""
    for adapter, hf_class in ((hf_llama, transformers.LlamaConfig), (hf_roberta, transformers.RobertaConfig)):
        for key, value in adapter.DEFAULTS.items():
            if hasattr(hf_class, key):
                assert getattr(hf_class, key) == value, (hf_class.__name__, key)
            else:
                assert key == "position_embedding_type"


# ---------------------------------------------------------------------- published configs


def resolved(config) -> dict:
    """The settings that decide a model's weights and outputs, whatever fields express them."""
    if hasattr(config, "kv_heads"):
        return dict(
            dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads, kv_heads=config.kv_heads,
            head_dim=config.head_dim, ffn=config.ffn_hidden_dim, norm_eps=config.norm_eps, theta=config.rope_theta,
            scaling=config.llama3_scaling, max_seq_len=config.max_seq_len, vocab=config.vocab_size,
            tied=config.tie_word_embeddings,
        )
    return dataclasses.asdict(config)


@pytest.mark.parametrize(
    "arch, published, published_count",
    [
        # Meta's model cards: Llama-2-7b 6,738,415,616; Meta-Llama-3(.1)-8B 8,030,261,248.
        ("llama2_7b", LLAMA2_7B, 6_738_415_616),
        ("llama3_8b", LLAMA3_8B, 8_030_261_248),
        ("llama3_1_8b", LLAMA3_1_8B, 8_030_261_248),
        ("roberta_base", ROBERTA_BASE, None),
        ("roberta_large", ROBERTA_LARGE, None),
    ],
)
def test_published_archs_are_the_published_models(arch, published, published_count):
    """The built-in arch equals the published config.json read by distlm, and has exactly the
    parameters of transformers' model of that config.json. For RoBERTa that model is
    RobertaForMaskedLM (no pooler; 124,697,433 for roberta-base, where the often-quoted
    124,645,632 is RobertaModel with its pooler and no LM head) less its token-type row,
    which distlm folds into the positions."""
    assert resolved(config_from_hf(published)[1]) == resolved(arch_config(arch))
    with torch.device("meta"):
        model = build_model(arch)  # no vocabulary given: the arch's own
        if published["model_type"] == "llama":
            reference = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(published))
        else:
            reference = transformers.RobertaForMaskedLM(transformers.RobertaConfig.from_dict(published))
    count = sum(p.numel() for p in model.parameters())
    reference_count = sum(p.numel() for p in reference.parameters())
    folded = published.get("type_vocab_size", 0) * published["hidden_size"]
    assert count == reference_count - folded
    if published_count is not None:
        assert count == published_count
    assert model.config.vocab_size == published["vocab_size"]


def test_tiny_archs_take_their_vocabulary_from_the_data():
    with pytest.raises(UsageError, match="--arch llama_tiny takes its vocabulary size from the data; pass vocab_size"):
        build_model("llama_tiny")
    with torch.device("meta"):
        assert build_model("llama3_8b", vocab_size=260).config.vocab_size == 260
        assert build_model("roberta_base", vocab_size=260, padding_idx=0).config.padding_idx == 0


def test_hf_tensor_specs_need_no_data():
    """Names, shapes and dtypes of an 8B export, from the meta model alone."""
    with torch.device("meta"):
        model = build_model("llama3_1_8b")
    specs = hf_tensor_specs(model.config, model.state_dict())
    assert len(specs) == 2 + 9 * 32 + 1
    spec, source = specs["model.layers.31.self_attn.k_proj.weight"]
    assert (spec.shape, source) == ((1024, 4096), "layers.31.attention.wk.weight")
    assert sum(spec.numel for spec, _ in specs.values()) == 8_030_261_248


def test_special_tokens_travel_through_the_config():
    config, tokens = hf_llama.config_from_hf(LLAMA3_1_8B)
    assert tokens == SpecialTokens(bos_token_id=128000, eos_token_id=128001, pad_token_id=None)
    assert config.padding_idx == 128001  # no pad token: the end-of-sequence id
    written = hf_llama.config_to_hf(config, tokens, torch.bfloat16)
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (128000, 128001, None)
    assert written["rope_scaling"]["rope_type"] == "llama3" and written["dtype"] == "bfloat16"
    assert transformers.LlamaConfig.from_dict(written).rope_parameters == (
        transformers.LlamaConfig.from_dict(LLAMA3_1_8B).rope_parameters
    )
