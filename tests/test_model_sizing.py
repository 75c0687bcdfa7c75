"""The model a command line builds, and the FLOPs it is charged for.

- fairseq's everyday masked-LM command on a 16k fairseq dictionary builds fairseq's model:
  the parameter count fairseq-fixed printed for the same command and dictionary (a fixture
  recorded by benchmarks/fairseq_roberta.py, with the command and version that printed it);
- the vocabulary follows the data's dictionary, an explicit --vocab-size, or the published one;
- torchtitan's llama3 debugmodel written as flags builds its 6,163,712 parameters and the
  rotary frequencies of the Python API;
- the FLOPs per token that MFU uses agree with torch's FlopCounterMode on real batches.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distlm.training.builder import choose_vocabulary, resolve_model_spec
from distlm.training.start_log import describe_shape
from distlm.config import ModelConfig, parse_args
from distlm.models import registry
from distlm.data import load_lm_data, load_vocabulary
from distlm.data.batches import with_host_facts
from distlm.data.dictionary import MASK_SYMBOL
from distlm.data.tokenizer import byte_dictionary, write_hf_tokenizer
from distlm.errors import UsageError
from distlm.models import build_model
from distlm.models.llama.config import LlamaConfig
from distlm.models.llama.model import LlamaCausalLM
from distlm.models.roberta.config import RobertaConfig
from distlm.models.flops import flops_per_token

FAIRSEQ_RECORD = json.loads((Path(__file__).parent / "fixtures" / "fairseq_roberta_params.json").read_text())


def built(argv: list[str], dictionary_dir: str | None = None, task: str = "masked_lm"):
    """The model (on meta) and vocabulary that the command line builds, as the Trainer chooses them."""
    config = parse_args(argv)
    spec = resolve_model_spec(config.model, config.data.tokens_per_sample)
    dictionary = load_vocabulary(dictionary_dir, task) if dictionary_dir else None
    vocabulary = choose_vocabulary(spec, dictionary, config.model)
    return spec.build(vocabulary.size, 1), vocabulary


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def fairseq_dictionary(tmp_path_factory) -> str:
    """The dictionary of the fixture, rebuilt from its recipe: 15,996 words."""
    directory = tmp_path_factory.mktemp("fairseq16k")
    words = 15_996
    assert FAIRSEQ_RECORD["dictionary"].startswith(f"dict.txt of {words} lines 'w<i> <{words} - i>'")
    (directory / "dict.txt").write_text("".join(f"w{i} {words - i}\n" for i in range(words)))
    return str(directory)


def test_fairseq_parameter_count_of_the_everyday_command_equals_fairseqs_own(fairseq_dictionary):
    # The command fairseq-train ran, word for word, with fairseq-train's data directory replaced.
    command = shlex.split(FAIRSEQ_RECORD["command"])
    assert command[:2] == ["fairseq-train", "bin"]
    model, vocabulary = built([fairseq_dictionary] + command[2:], fairseq_dictionary)
    # fairseq: "dictionary: 16000 types", plus <mask> for the masked LM.
    assert model.embed_tokens.num_embeddings == FAIRSEQ_RECORD["dictionary_types"] + 1 == vocabulary.size
    assert model.embed_positions.num_embeddings == 128 + 2  # --tokens-per-sample, fairseq's padding offset
    assert count(model) == FAIRSEQ_RECORD["num_shared_model_params"]
    assert "dict.txt + <mask>" in vocabulary.source
    # An explicit --max-positions still wins over --tokens-per-sample.
    model, _ = built([fairseq_dictionary] + command[2:] + ["--max-positions", "512"], fairseq_dictionary)
    assert model.embed_positions.num_embeddings == 514


def test_vocabulary_explicit_padded_published_and_too_small(data_dir):
    base = [data_dir, "--arch", "roberta_base", "--encoder-layers", "1", "--encoder-embed-dim", "32",
            "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2"]
    symbols = len(load_vocabulary(data_dir, "masked_lm"))  # 40 words + 4 specials + <mask>
    model, vocabulary = built(base, data_dir)
    assert vocabulary.size == symbols == 45 and model.embed_tokens.num_embeddings == 45
    model, vocabulary = built(base + ["--pad-vocab-to-multiple", "64"], data_dir)
    assert vocabulary.size == 64 and "45 padded to a multiple of 64" in vocabulary.source
    model, vocabulary = built(base + ["--vocab-size", "50265"], data_dir)  # fairseq's GPT-2 BPE rows, asked for
    assert model.embed_tokens.num_embeddings == 50265 and vocabulary.source == "--vocab-size"
    with pytest.raises(UsageError, match="dictionary has 45 symbols but roberta_base has a vocabulary of 44"):
        built(base + ["--vocab-size", "44"], data_dir)
    # No data dictionary (a user's own data object): the published vocabulary.
    _, vocabulary = built(base)
    assert vocabulary.size == 50265 and "published" in vocabulary.source


def test_data_tokenized_by_a_hugging_face_tokenizer_keeps_the_published_vocabulary(tmp_path):
    """A tokenizer that fits the published vocabulary (as the published model's own does)
    keeps its rows, so weights and ids stay the published model's; a from-scratch arch
    without one takes the tokenizer's size."""
    dictionary = byte_dictionary()
    dictionary.add_symbol(MASK_SYMBOL)
    write_hf_tokenizer(dictionary, tmp_path, "masked_lm")
    small = ["--encoder-layers", "1", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
             "--encoder-attention-heads", "2"]
    _, vocabulary = built([str(tmp_path), "--arch", "roberta_base", *small], str(tmp_path))
    assert vocabulary.size == 50265
    assert vocabulary.source == f"roberta_base's published vocabulary, as the data's tokenizer {tmp_path} has 261 ids"
    _, vocabulary = built([str(tmp_path), "--arch", "roberta_tiny"], str(tmp_path))
    assert (vocabulary.size, vocabulary.source) == (261, f"the data's tokenizer {tmp_path}")


def test_torchtitan_llama3_debugmodel_as_flags_builds_its_parameters_and_rope():
    flags = ("--arch llama_tiny --decoder-layers 6 --decoder-embed-dim 256 --decoder-attention-heads 16 "
             "--kv-heads 16 --multiple-of 256 --vocab-size 2048 --rope-theta 500000 --rope-scaling llama3 "
             "--rope-factor 8 --rope-low-freq-factor 1 --rope-high-freq-factor 4 --rope-original-max-seq-len 8192")
    model, vocabulary = built(flags.split(), task="causal_lm")
    assert count(model) == 6_163_712  # torchtitan's own count for its llama3 debugmodel
    python_api = LlamaCausalLM(LlamaConfig(dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256,
                                           rope_theta=500_000.0, rope_type="llama3", max_seq_len=2048))
    python_api.init_buffers()
    model.to_empty(device="cpu")
    model.init_buffers()
    assert torch.equal(model.rope_cos, python_api.rope_cos) and torch.equal(model.rope_sin, python_api.rope_sin)
    shape = describe_shape(model.config, vocabulary)
    assert shape == ("6 layers, width 256, 16 heads, 16 KV heads, head size 16, FFN 768, vocabulary 2,048 "
                     "(--vocab-size), 2048 rotary positions (theta 500000, llama3 scaling (factor 8, low 1, high 4, "
                     "original 8192 positions))")


def test_heads_without_kv_heads_mean_no_grouping_and_toml_keys_match_flags(tmp_path):
    # llama_tiny groups 6 query heads over 2 KV heads; new heads alone drop the grouping.
    model, _ = built("--arch llama_tiny --decoder-attention-heads 12 --vocab-size 64".split(), task="causal_lm")
    assert (model.config.n_heads, model.config.kv_heads) == (12, 12)
    model, _ = built("--arch llama_tiny --decoder-attention-heads 12 --kv-heads 4 --vocab-size 64".split())
    assert (model.config.n_heads, model.config.kv_heads) == (12, 4)
    toml = tmp_path / "model.toml"
    toml.write_text('[model]\narch = "llama_tiny"\nrope_theta = 500000.0\nrope_scaling = "llama3"\n'
                    'head_dim = 16\nnorm_eps = 1e-6\ntie_word_embeddings = true\nvocab_size = 64\n')
    model, _ = built(["--config", str(toml)])
    config = model.config
    assert (config.rope_theta, config.rope_type, config.head_dim, config.norm_eps, config.tie_word_embeddings) == (
        500000.0, "llama3", 16, 1e-6, True)
    with pytest.raises(UsageError, match="--rope-scaling yarn is not one of: none, llama3"):
        parse_args(["--rope-scaling", "yarn"])
    with pytest.raises(UsageError, match="--rope-theta belongs to a llama model, but --arch roberta_tiny"):
        built(["--arch", "roberta_tiny", "--rope-theta", "1e6", "--vocab-size", "64"])


def measured_flops_per_token(model: torch.nn.Module, batch: dict, masked: bool) -> float:
    """FLOPs of one forward and backward as FlopCounterMode counts them, per input token.
    SDPA's math path runs attention as counted matmuls (CPU's fused kernel has no FLOP formula)."""
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        if masked:
            logits = model(batch["input_ids"], masked_positions=batch["masked_positions"], has_padding=False)
            targets = batch["targets"].flatten()[batch["masked_positions"]]
        else:
            logits = model(batch["input_ids"]).flatten(0, 1)
            targets = batch["targets"].flatten()
        F.cross_entropy(logits, targets, ignore_index=-100).backward()
    return counter.get_total_flops() / batch["input_ids"].numel()


@pytest.mark.parametrize("arch, task", [("roberta_tiny", "masked_lm"), ("llama_tiny", "causal_lm")])
def test_flops_per_token_match_flop_counter_on_real_batches(arch, task):
    seq_len = 64
    data = load_lm_data(None, split="train", task=task, tokens_per_sample=seq_len, sample_break_mode="none")
    batch = with_host_facts(data.collate([(0, i) for i in range(4)]), data.dictionary.pad())
    torch.manual_seed(0)
    # A vocabulary of a word-level size (the byte ids fill its first rows), where the output
    # projection is a large share of the FLOPs, as in real models.
    model = build_model(arch, vocab_size=4096)
    measured = measured_flops_per_token(model, batch, masked=task == "masked_lm")
    if task == "masked_lm":
        counted = batch["target_count"] / batch["input_ids"].numel()
        # Counted masked positions, and the expected fraction (--mask-prob) on a real batch.
        assert flops_per_token(model, seq_len, counted) == pytest.approx(measured, rel=0.05)
        assert flops_per_token(model, seq_len, 0.15) == pytest.approx(measured, rel=0.05)  # load_lm_data's mask_prob
        # Charging the LM head at every position, as MFU did, is far off.
        assert flops_per_token(model, seq_len) > 1.3 * measured
        # Without masked positions the head runs at every position: then 1 is right.
        measured = measured_flops_per_token(model, batch, masked=False)
    assert flops_per_token(model, seq_len, 1.0) == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("family, config_class", [("llama", LlamaConfig), ("roberta", RobertaConfig)])
def test_every_model_config_field_has_a_flag(family, config_class):
    """What the Python API accepts, the command line does: each field is set by a flag of
    its family (the shared ones included), except the padding id, which the data's dictionary
    fixes; and every flag of a family is a setting of the command line."""
    flags = registry.family(family).flags
    set_by_flags = set(flags.values()) | {"vocab_size"}  # --vocab-size, through choose_vocabulary
    assert set_by_flags == {f.name for f in dataclasses.fields(config_class)} - {"padding_idx"}
    assert set(flags) <= {f.name for f in dataclasses.fields(ModelConfig)}
