"""A model family is one record: a toy family (tests/toy_family) added to the registry's list alone
is refused nowhere, trains, counts its parameters and FLOPs, and plans; and the three real
families' records describe the models they build."""

from __future__ import annotations

import json

import pytest
import torch

from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.models import registry
from distlm.models.flops import count_parameter_tensors, count_parameters, flops_per_token
from distlm.plan.__main__ import main as plan_main
from distlm.training.trainer import Trainer


@pytest.fixture
def toy_family(monkeypatch):
    """The registry with the toy family's package on its list, as adding a family's line does."""
    monkeypatch.setattr(registry, "FAMILY_PACKAGES", registry.FAMILY_PACKAGES + ("toy_family",))
    registry.families.cache_clear()
    yield registry.family("toy")
    registry.families.cache_clear()


def test_a_family_added_through_the_registry_alone_trains(toy_family, tmp_path):
    args = ["--arch", "toy_tiny", "--decoder-layers", "3", "--batch-size", "4", "--tokens-per-sample", "32",
            "--max-update", "6", "--lr", "1e-2", "--warmup-updates", "0", "--log-interval", "1",
            "--disable-validation", "--save-dir", str(tmp_path / "save"), "--device", "cpu"]
    trainer = Trainer(parse_args(args))
    assert type(trainer.model).__name__ == "ToyCausalLM" and len(trainer.model.layers) == 3  # the flag sized it
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    summary = trainer.fit()
    assert summary["update"] == 6 and torch.isfinite(torch.tensor(summary["loss"]))
    assert all(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    saved = json.loads((tmp_path / "save" / "checkpoint_last" / "distlm.json").read_text())
    assert saved["family"] == "toy" and saved["model_config"]["n_layers"] == 3
    # Its parameters and FLOPs come from its own formulas, and they describe the model it built.
    model = trainer.model
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    assert count_parameter_tensors(model) == len(list(model.parameters()))
    matmul = sum(p.numel() for name, p in model.named_parameters() if name != "embed.weight")
    assert flops_per_token(model, 32) == pytest.approx(6 * matmul)  # no attention


def test_a_family_added_through_the_registry_alone_plans(toy_family, capsys):
    assert plan_main(["--arch", "toy_tiny", "--vocab-size", "1000", "--cluster", "p4d.24xlarge", "--nodes", "1,2",
                      "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["nodes"] for row in rows] == [1, 2] and all(row["tokens_per_s"] > 0 for row in rows)


def test_a_family_flag_on_another_family_is_refused_by_its_record(toy_family):
    with pytest.raises(UsageError, match="--num-experts belongs to a qwen3_moe model, but --arch toy_tiny is a toy "
                                         "model; drop it or use the --decoder-\\* flags"):
        parse_args(["--arch", "toy_tiny", "--num-experts", "4"])


@pytest.mark.parametrize("arch", ["roberta_tiny", "llama_tiny", "qwen3_moe_tiny"])
def test_each_family_record_describes_the_models_it_builds(arch):
    family = registry.family_of_arch(arch)
    model = registry.build_model(arch, vocab_size=100)
    assert isinstance(model, family.model_class) and model.task == family.task.name
    assert registry.family_of_model(model) is family and registry.family_of_config(model.config) is family
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    for adapter in family.hf_adapters:
        assert adapter.model_class is family.model_class and adapter.config_class is family.config_class
