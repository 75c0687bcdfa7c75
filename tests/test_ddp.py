"""DDP through the Trainer equals single-process training.

Each test compares a single-process reference computed in this process with real 2-rank
gloo runs of the same global batch; the module's 2-rank runs share one job (starting the
processes and torch costs more than their 5 updates).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import Scenarios
from distlm.config import parse_args
from distlm.state.full import consolidated_parameters
from distlm.training.trainer import Trainer

UPDATES = 5


def common_args(data_dir: str, save_dir: str, arch: str = "roberta_tiny") -> list[str]:
    return [
        "--data", data_dir, "--arch", arch, "--tokens-per-sample", "32",
        "--dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--warmup-updates", "2",
        "--max-update", "100", "--log-interval", "1000", "--save-dir", save_dir, "--no-save",
        "--device", "cpu", "--seed", "3", "--adam-eps", "1e-6",
    ]


def train(args: list[str], updates: int = UPDATES) -> dict:
    """Run ``updates`` updates; return initial and final parameters and per-update global gradient norms."""
    trainer = Trainer(parse_args(args))
    initial = consolidated_parameters(trainer.model)
    batches = trainer.update_batches()
    gnorms = [trainer.train_step(next(batches))["gnorm"] for _ in range(updates)]
    # Gathered the way checkpoints and export gather them, so sharded strategies compare too.
    params = consolidated_parameters(trainer.model)
    return {"initial": initial, "params": params, "gnorms": gnorms}


def assert_params_close(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


# Tolerance: DDP sums two half-batch gradients where one process reduces the whole
# batch inside its matmuls, so gradients differ by fp32 reassociation (~1e-7 relative).
# Adam divides by sqrt(v) + eps: for elements with tiny gradients that amplifies the
# relative error (an element whose gradient is ~1e-9, pure rounding noise, moves by
# lr * g / (|g| + eps), so eps bounds the effect); with --adam-eps 1e-6 the largest
# difference measured here is ~2e-7 after 5-8 updates, with fairseq's 1e-8 it reaches ~7e-6.
# One update more or less, or a wrong batch, moves parameters by ~1e-4-1e-3 (lr 1e-3),
# so 5e-6 keeps a wide margin on both sides; a mis-normalised gradient, which Adam would
# hide, shows in the gradient norms compared below.
PARAM_ATOL = 5e-6


ARCHS = ("roberta_tiny", "llama_tiny")


@pytest.fixture(scope="module")
def references(data_dir, tmp_path_factory) -> dict:
    """One process, the global batch of 8, per architecture (--no-save: the save dir is unused)."""
    root = str(tmp_path_factory.mktemp("reference"))
    return {arch: train(common_args(data_dir, root, arch) + ["--batch-size", "8"]) for arch in ARCHS}


@pytest.fixture(scope="module")
def two_ranks(data_dir, tmp_path_factory) -> Scenarios:
    """The module's 2-rank runs in one job: the global batch of 8 as 2 x 4, and as
    2 ranks x update-freq 2 x 2."""
    root = str(tmp_path_factory.mktemp("ddp"))
    return Scenarios(2, [
        *[(f"ddp-{arch}", train, (common_args(data_dir, root, arch) + ["--batch-size", "4"],)) for arch in ARCHS],
        ("ddp-update-freq", train, (common_args(data_dir, root) + ["--batch-size", "2", "--update-freq", "2"],)),
    ], timeout=300)


@pytest.mark.parametrize("arch", ARCHS)
def test_ddp_two_ranks_equal_single_process(arch, references, two_ranks):
    reference = references[arch]
    ranks = two_ranks[f"ddp-{arch}"]
    for result in ranks:
        assert_params_close(result["params"], reference["params"], PARAM_ATOL)
        # Adam hides a constant gradient factor; the global norm does not.
        np.testing.assert_allclose(result["gnorms"], reference["gnorms"], rtol=1e-5)
    # Replicas agree exactly, not just approximately.
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


def test_update_freq_two_equals_double_batch(data_dir, tmp_path, references):
    reference = references["roberta_tiny"]
    accumulated = train(common_args(data_dir, str(tmp_path)) + ["--batch-size", "4", "--update-freq", "2"])
    assert_params_close(accumulated["params"], reference["params"], PARAM_ATOL)
    np.testing.assert_allclose(accumulated["gnorms"], reference["gnorms"], rtol=1e-5)


def test_ddp_with_update_freq_equals_single_process(references, two_ranks):
    """2 ranks x update-freq 2 x batch 2 is the same global batch of 8 as one process."""
    reference = references["roberta_tiny"]
    ranks = two_ranks["ddp-update-freq"]
    assert_params_close(ranks[0]["params"], reference["params"], PARAM_ATOL)
    np.testing.assert_allclose(ranks[0]["gnorms"], reference["gnorms"], rtol=1e-5)
