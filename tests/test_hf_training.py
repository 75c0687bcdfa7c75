"""Hugging Face in and out through training: --init-from-hf under every layout, and
``python -m distlm.export --hf`` of checkpoints that sharded strategies wrote.

The adapters themselves are checked in test_hf_models.py; here the whole path is:
transformers' files -> distlm's Trainer -> a checkpoint -> transformers' own model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

from distributed import Scenarios
from distlm import checkpoint
from distlm.checkpoint import CheckpointReader
from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.export.cli import main as export_main
from distlm.models.hf import io, load_hf_model
from distlm.state.full import consolidated_parameters
from distlm.train import main as train_main
from distlm.training.trainer import Trainer
from test_ddp import common_args
from test_hf_models import LLAMA_SETTINGS, ROBERTA_SETTINGS, perturbed

# The data's dictionary (40 words, fairseq's 4 specials and <mask>) fits in 64 rows.
HF_VOCAB = 64


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """A small Llama (grouped-query attention, llama3 rope) and RoBERTa in Hugging Face
    layout, every weight perturbed so that a wrong mapping cannot hide."""
    root = tmp_path_factory.mktemp("hf_models")
    torch.manual_seed(0)
    models = {
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA_SETTINGS, "vocab_size": HF_VOCAB})),
        "roberta": transformers.RobertaForMaskedLM(
            transformers.RobertaConfig(**{**ROBERTA_SETTINGS, "vocab_size": HF_VOCAB, "max_position_embeddings": 70})
        ),
    }
    dirs = {}
    for name, model in models.items():
        dirs[name] = str(root / name)
        perturbed(model, seed=len(name)).save_pretrained(dirs[name])
    return dirs


def hf_args(data: str, save_dir: str, hf_dir: str, task: str) -> list[str]:
    args = [a for a in common_args(data, save_dir) if a not in ("--arch", "roberta_tiny", "--no-save")]
    return args + ["--init-from-hf", hf_dir, "--task", task, "--batch-size", "4", "--disable-validation"]


def initial_parameters(runs: list[tuple[str, list[str]]]) -> dict[str, dict]:
    """For each (name, args) run: every parameter whole, before any update; the elements
    this rank read from the safetensors files; and the elements of its own shards."""
    read = count_safetensors_reads()
    results = {}
    for name, args in runs:
        read.clear()
        model = Trainer(parse_args(args)).model
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        results[name] = {"params": consolidated_parameters(model), "read": sum(read), "held": held}
    return results


def count_safetensors_reads(monkeypatch=None) -> list[int]:
    """From now on (in a spawned worker) or until the test ends (``monkeypatch``), the
    elements of each tensor, or part of one, read from safetensors files: whole tensors and
    parts alike go through ``SafetensorsWeights.read``."""
    counts: list[int] = []
    original = io.SafetensorsWeights.read

    def read(weights, name, region=None):
        tensor = original(weights, name, region)
        counts.append(tensor.numel())
        return tensor

    if monkeypatch is not None:
        monkeypatch.setattr(io.SafetensorsWeights, "read", read)
    else:
        io.SafetensorsWeights.read = read
    return counts


@pytest.fixture(scope="module")
def four_rank_job(data_dir, hf_dirs, tmp_path_factory) -> tuple[Path, Scenarios]:
    """The module's 4-rank scenarios in one job (starting 4 processes and torch costs more
    than they do): the fsdp x tp2 trainings, then the --init-from-hf layouts."""
    root = tmp_path_factory.mktemp("four_ranks")
    init_runs = []
    for family, task in (("llama", "causal_lm"), ("roberta", "masked_lm")):
        base = hf_args(data_dir, str(root / "init" / family), hf_dirs[family], task) + ["--no-save"]
        init_runs += [(f"{family}-ddp", base), (f"{family}-fsdp", base + ["--strategy", "fsdp"]),
                      (f"{family}-zero1-tp2", base + ["--strategy", "zero1", "--tp-degree", "2"])]
    train_runs = []
    for arch in FSDP_TP2_ARCHS:
        args = [a for a in common_args(data_dir, str(root / "train" / arch), arch) if a != "--no-save"]
        train_runs.append((args + ["--batch-size", "4", "--strategy", "fsdp", "--tp-degree", "2",
                                   "--disable-validation"], FSDP_TP2_UPDATES))
    return root, Scenarios(4, [("train", train_and_save, (train_runs,)), ("init", initial_parameters, (init_runs,))],
                           timeout=400)


def test_init_from_hf_loads_the_weights_exactly_under_every_layout(hf_dirs, four_rank_job):
    """Exact weights under ddp, fsdp and zero1 x tp 2 on 4 ranks; a rank of a sharded layout
    reads from the files about its own shards (plus the whole heads its rows of q/k touch,
    and RoBERTa's token-type row), not the whole model."""
    ranks = four_rank_job[1]["init"]
    assert len(ranks) == 4
    for family in ("llama", "roberta"):
        expected = dict(load_hf_model(hf_dirs[family])[0].named_parameters())
        total = sum(value.numel() for value in expected.values())
        token_type_row = ROBERTA_SETTINGS["hidden_size"] if family == "roberta" else 0  # folded into the positions
        for layout in ("ddp", "fsdp", "zero1-tp2"):
            for rank in ranks:
                run = rank[f"{family}-{layout}"]
                assert run["params"].keys() == expected.keys(), (family, layout)
                for name, value in expected.items():
                    assert torch.equal(run["params"][name], value.detach()), (family, layout, name)
                if layout == "ddp":
                    assert run["held"] == run["read"] - token_type_row == total, (family, run["held"], run["read"])
                else:
                    assert run["held"] <= run["read"] <= 1.25 * run["held"], (family, layout, run["held"], run["read"])
        # fsdp on 4 ranks: a quarter each; tp 2: half each, plus the replicated norms (and RoBERTa's biases).
        assert all(rank[f"{family}-fsdp"]["read"] < 0.3 * total for rank in ranks), family
        assert all(rank[f"{family}-zero1-tp2"]["read"] < 0.6 * total for rank in ranks), family


def save_initial_checkpoint(args: list[str]) -> None:
    Trainer(parse_args(args)).save_checkpoint()


@pytest.mark.parametrize("family", ["llama", "roberta"])
def test_hf_in_checkpoint_out_gives_transformers_the_same_model(data_dir, hf_dirs, tmp_path, family):
    task = "causal_lm" if family == "llama" else "masked_lm"
    save_initial_checkpoint(hf_args(data_dir, str(tmp_path / "run"), hf_dirs[family], task))
    out = tmp_path / "exported"
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--hf", str(out), "--max-shard-size", "40KB"]) == 0
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]  # sharded
    load = transformers.AutoModelForCausalLM if family == "llama" else transformers.AutoModelForMaskedLM
    original, exported = (load.from_pretrained(path, dtype=torch.float32).eval() for path in (hf_dirs[family], out))
    original_weights, exported_weights = original.state_dict(), exported.state_dict()
    assert original_weights.keys() == exported_weights.keys()
    for name, value in original_weights.items():
        if "position_embeddings" in name or "token_type_embeddings" in name:
            continue  # distlm folds the token-type row into the positions: compared as their sum below
        assert torch.equal(exported_weights[name], value), name
    if family == "roberta":
        prefix = "roberta.embeddings."

        def summed(weights):
            return weights[prefix + "position_embeddings.weight"] + weights[prefix + "token_type_embeddings.weight"][0]

        # Folding adds the row in fp32, once: within one rounding of the larger term.
        torch.testing.assert_close(summed(exported_weights), summed(original_weights), rtol=0, atol=1e-7)
    ids = torch.randint(4, HF_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, original(ids).logits, rtol=0, atol=1e-5)


def train_and_save(runs: list[tuple[list[str], int]]) -> None:
    for args, updates in runs:
        trainer = Trainer(parse_args(args))
        batches = trainer.update_batches()
        for _ in range(updates):
            trainer.train_step(next(batches))
        trainer.save_checkpoint()


FSDP_TP2_ARCHS = ("llama_tiny", "roberta_tiny")
# Two updates: the checkpoint then holds trained weights and Adam state of every shard.
FSDP_TP2_UPDATES = 2


def test_fsdp_tp2_checkpoint_exports_a_model_transformers_runs(four_rank_job):
    """2 updates under FSDP x TP 2 on 4 ranks; transformers' logits of the --hf export equal
    distlm's own model loaded from the plain export (distlm's names) within 1e-5."""
    four_rank_job[1]["train"]  # fails the test with the training's traceback
    root, _ = four_rank_job
    for arch, load in zip(FSDP_TP2_ARCHS, (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM)):
        save_dir = root / "train" / arch
        assert export_main(["--checkpoint", str(save_dir), "--hf", str(save_dir / "hf")]) == 0
        reader = CheckpointReader(save_dir)
        assert reader.meta["progress"]["num_updates"] == FSDP_TP2_UPDATES
        distlm_model = _distlm_model(reader)
        hf = load.from_pretrained(save_dir / "hf", dtype=torch.float32).eval()
        ids = torch.randint(4, 40, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, distlm_model(ids), rtol=0, atol=1e-5)


def _distlm_model(reader: CheckpointReader) -> torch.nn.Module:
    from distlm.models.llama.config import LlamaConfig
    from distlm.models.llama.model import LlamaCausalLM
    from distlm.models.roberta.config import RobertaConfig
    from distlm.models.roberta.model import RobertaMaskedLM

    classes = {"llama": (LlamaCausalLM, LlamaConfig), "roberta": (RobertaMaskedLM, RobertaConfig)}
    model_class, config_class = classes[reader.meta["family"]]
    model = model_class(config_class(**reader.meta["model_config"]))
    model.load_state_dict(dict(reader.model_tensors()), strict=False)  # buffers are derived, not saved
    model.init_buffers()
    return model.eval()


def test_hf_settings_distlm_cannot_run_are_refused_by_name(data_dir, hf_dirs, tmp_path):
    llama = hf_args(data_dir, str(tmp_path), hf_dirs["llama"], "causal_lm") + ["--no-save"]
    with pytest.raises(UsageError, match="--arch roberta_tiny is a roberta model but --init-from-hf"):
        Trainer(parse_args(llama + ["--arch", "roberta_tiny"]))
    with pytest.raises(UsageError, match="takes the model's sizes from .* drop the flags that set n_layers"):
        Trainer(parse_args(llama + ["--decoder-layers", "3"]))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UsageError, match="^config.json model_type='gpt2'"):
        Trainer(parse_args(hf_args(data_dir, str(tmp_path), str(unknown), "causal_lm") + ["--no-save"]))
    small = tmp_path / "small_vocab"
    config = json.loads((Path(hf_dirs["llama"]) / "config.json").read_text())
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 16}))
    with pytest.raises(UsageError, match="dictionary has 44 symbols but hf_llama has a vocabulary of 16"):
        Trainer(parse_args(hf_args(data_dir, str(tmp_path), str(small), "causal_lm") + ["--no-save"]))


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"attention_bias": True}, "attention_bias=True: distlm's Llama attention projections have no bias"),
        ({"mlp_bias": True}, "mlp_bias=True: distlm's Llama feed-forward projections have no bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
         "rope_scaling.rope_type='yarn': distlm implements the rope types default and llama3 only"),
        ({"model_type": "gpt2"}, "model_type='gpt2': distlm converts only roberta (RobertaForMaskedLM), llama"),
    ],
    ids=["attention_bias", "mlp_bias", "rope_type", "model_type"],
)
def test_train_refuses_hf_settings_distlm_cannot_run_with_exit_2_and_one_line(
    change, refusal, data_dir, hf_dirs, tmp_path, capsys
):
    """Through the command line's entry point: exit status 2, one line naming the setting,
    no traceback, and no update trained."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    config = json.loads((Path(hf_dirs["llama"]) / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    (hf_dir / "model.safetensors").symlink_to(Path(hf_dirs["llama"]) / "model.safetensors")
    code = train_main(hf_args(data_dir, str(tmp_path / "run"), str(hf_dir), "causal_lm") + ["--no-save"])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("distlm: error:")]
    assert code == 2 and len(errors) == 1, captured.err
    assert errors[0].startswith(f"distlm: error: config.json {refusal}"), errors
    assert "Traceback" not in captured.err and '"kind": "train"' not in captured.out


def test_a_checkpoint_in_save_dir_takes_precedence_over_init_from_hf(data_dir, hf_dirs, tmp_path, caplog, monkeypatch):
    """The first run starts from the Hugging Face weights and says so; the second finds its
    checkpoint, resumes from it and says so, and reads nothing from --init-from-hf."""
    reads = count_safetensors_reads(monkeypatch)
    save_dir = tmp_path / "run"
    args = hf_args(data_dir, str(save_dir), hf_dirs["llama"], "causal_lm")
    with caplog.at_level("INFO", logger="distlm"):
        Trainer(parse_args(args + ["--max-update", "2"])).fit()
        first = [record.getMessage() for record in caplog.records]
        assert sum(reads) > 0
        reads.clear()
        caplog.clear()
        resumed = Trainer(parse_args(args + ["--max-update", "4"]))
        second = [record.getMessage() for record in caplog.records]
    assert f"starting from the weights in --init-from-hf {hf_dirs['llama']}" in first
    assert resumed.resumed_at == 2 and reads == []
    assert any(line.startswith(f"resumed from {save_dir / checkpoint.LAST} at update 2 ") for line in second), second
    assert not any(line.startswith("starting from") for line in second), second
    # The weights are the checkpoint's, two updates away from the Hugging Face ones.
    saved = CheckpointReader(save_dir)
    params = consolidated_parameters(resumed.model)
    hf_params = dict(load_hf_model(hf_dirs["llama"])[0].named_parameters())
    assert params.keys() == hf_params.keys()
    for name, value in params.items():
        assert torch.equal(value, saved.tensor(f"model.{name}")), name
    assert not torch.equal(params["output.weight"], hf_params["output.weight"])
