"""Validation, checkpoint_best, early stopping, and fairseq's everyday command line."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import numpy as np
import pytest
import torch

from distributed import Scenarios
from distlm.training import validation
from distlm.checkpoint import CheckpointReader
from distlm.config import parse_args
from distlm.data.indexed_dataset import write_indexed_dataset
from distlm.data.masking import IGNORE_INDEX
from distlm.errors import UsageError
from distlm.training.evaluation import Validator
from distlm.train import main
from distlm.training.trainer import Trainer
from test_ddp import common_args


def validation_losses(runs: list[list[str]]) -> list[float]:
    """The first subset's validation loss of each run's initial model (every layout starts
    from the same weights, so the same parameters are evaluated)."""
    losses = []
    for args in runs:
        trainer = Trainer(parse_args(args))
        losses.append(trainer.validator.validate(trainer.model)[0].loss)
    return losses


ARCHS = ("roberta_tiny", "llama_tiny")


def validation_layouts(data_dir: str, save_dir: str, arch: str) -> tuple[list[str], list[str]]:
    """(the common arguments, the uneven split's)."""
    args = common_args(data_dir, save_dir, arch) + ["--batch-size", "3"]
    return args, args + ["--tokens-per-sample", "24", "--batch-size-valid", "2"]


@pytest.fixture(scope="module")
def two_rank_losses(data_dir, tmp_path_factory) -> Scenarios:
    """Both architectures' layouts in one 2-rank job (starting the processes and torch
    costs more than the validations): ddp, fsdp, ddp x tp2, and the uneven split."""
    root = str(tmp_path_factory.mktemp("validation"))
    scenarios = []
    for arch in ARCHS:
        args, uneven = validation_layouts(data_dir, root, arch)
        scenarios.append((arch, validation_losses, ([args, args + ["--strategy", "fsdp"], args + ["--tp-degree", "2"],
                                                     uneven],)))
    return Scenarios(2, scenarios, timeout=300)


@pytest.mark.parametrize("arch", ARCHS)
def test_validation_loss_is_the_whole_split_under_every_layout(data_dir, tmp_path, arch, two_rank_losses):
    """ddp, fsdp and ddp x tp2 on 2 ranks against one process: the summed loss over every
    target token of the split, so equal up to fp32 reassociation of the sums. The split
    of the last layout (17 samples at 24 tokens, batches of 2) leaves rank 1 a batch short:
    it evaluates a batch whose targets are all ignored, which must count no tokens."""
    singles = validation_losses(list(validation_layouts(data_dir, str(tmp_path), arch)))
    ranks = two_rank_losses[arch]
    for rank in ranks:
        assert len(rank) == 4
        for loss, single in zip(rank, [singles[0]] * 3 + [singles[1]]):
            assert loss == pytest.approx(single, rel=1e-5)
    assert ranks[0] == ranks[1]  # every rank reports the same reduced value
    assert 3 < singles[0] < 8  # a real loss of an untrained model (log2 of ~45 symbols is 5.5)


def log_lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_best_checkpoint_and_patience(data_dir, tmp_path, capsys, caplog):
    """Validation every 2 updates with a learning rate far too high for Adam: validation
    gets worse after its first value, so --patience 1 stops at the second validation, and
    checkpoint_best holds the parameters of the first (those of checkpoint_2)."""
    args = [a for a in common_args(data_dir, str(tmp_path), "roberta_tiny") if a != "--no-save"]
    args += ["--batch-size", "4", "--lr", "0.2", "--warmup-updates", "0", "--clip-norm", "0",
             "--validate-interval-updates", "2", "--save-interval-updates", "2", "--patience", "1",
             "--max-update", "20", "--log-format", "json"]
    with caplog.at_level("INFO", logger="distlm"):
        assert main(args) == 0
    lines = log_lines(capsys)
    valid = [line for line in lines if line["kind"] == "valid"]
    assert [line["update"] for line in valid] == [2, 4]
    assert valid[1]["loss"] > valid[0]["loss"] and valid[1]["best_loss"] == valid[0]["loss"]
    assert lines[-1]["kind"] == "summary" and lines[-1]["update"] == 4
    best, at_2 = CheckpointReader(tmp_path / "checkpoint_best"), CheckpointReader(tmp_path / "checkpoint_2")
    assert best.meta["progress"]["num_updates"] == 2 and best.meta["progress"]["best"] == pytest.approx(
        valid[0]["loss"], abs=1e-4)
    for name, value in at_2.model_tensors():
        assert torch.equal(best.tensor(f"model.{name}"), value), name
    # The best value is in checkpoint_last too, so a resumed run keeps comparing against it.
    assert CheckpointReader(tmp_path / "checkpoint_last").meta["progress"]["best"] == best.meta["progress"]["best"]
    assert any(r.getMessage().startswith("early stop: validation loss has not improved for the last 1 validations")
               for r in caplog.records)
    # Resumed with more patience: its first validation is judged against the saved best.
    assert main(args + ["--max-update", "6", "--patience", "5"]) == 0  # the later flag wins, as in argparse
    resumed = [line for line in log_lines(capsys) if line["kind"] == "valid"]
    assert [line["update"] for line in resumed] == [6]
    assert resumed[0]["best_loss"] == pytest.approx(min(valid[0]["loss"], resumed[0]["loss"]), abs=1e-4)


def test_valid_subsets_max_valid_steps_and_a_maximised_metric(data_dir, tmp_path, capsys):
    """Two subsets, each cut to one batch by --max-valid-steps; the best value follows the
    first subset, and --maximize-best-checkpoint-metric keeps the largest."""
    data = tmp_path / "data"
    data.mkdir()
    for name in os.listdir(data_dir):
        (data / name).symlink_to(os.path.join(data_dir, name))
    first_five = [np.append(np.arange(4, 4 + n), 2) for n in range(5, 10)]
    write_indexed_dataset(str(data / "valid1"), first_five, np.uint16)
    args = [a for a in common_args(str(data), str(tmp_path / "save"), "llama_tiny") if a != "--no-save"] + [
        "--batch-size", "4", "--batch-size-valid", "2", "--valid-subset", "valid,valid1", "--max-valid-steps", "1",
        "--validate-interval-updates", "1", "--max-update", "3", "--lr", "0.05", "--warmup-updates", "0",
        "--maximize-best-checkpoint-metric", "--patience", "2", "--log-format", "json", "--no-save"]
    trainer = Trainer(parse_args(args))
    results = trainer.validator.validate(trainer.model)
    assert [r.subset for r in results] == ["valid", "valid1"]
    for result in results:  # one batch of 2 samples: their target tokens (the next-token targets of a causal LM)
        subset = trainer.validator.subsets[result.subset]
        batch = subset.collate([(0, 0), (0, 1)])
        assert result.target_tokens == int((batch["targets"] != IGNORE_INDEX).sum())
    assert main(args) == 0
    lines = [line for line in log_lines(capsys) if line["kind"] == "valid"]
    valid = [line for line in lines if line["subset"] == "valid"]
    assert {line["subset"] for line in lines} == {"valid", "valid1"}
    for seen in range(1, len(valid) + 1):  # the best is the largest first-subset loss so far
        assert valid[seen - 1]["best_loss"] == pytest.approx(max(v["loss"] for v in valid[:seen]), abs=1e-4)


FAIRSEQ_COMMAND = (
    "DATA --task masked_lm --criterion masked_lm --arch roberta_base "
    "--encoder-layers 2 --encoder-embed-dim 128 --encoder-ffn-embed-dim 512 --encoder-attention-heads 2 "
    "--cpu --tokens-per-sample 128 --sample-break-mode none --batch-size 8 --optimizer adam "
    "--adam-betas (0.9,0.98) --lr 5e-4 --lr-scheduler polynomial_decay --warmup-updates 10 "
    "--total-num-update 50 --max-update 50 --dropout 0.1 --attention-dropout 0.1 --weight-decay 0.01 "
    "--clip-norm 0.0 --seed 1 --num-workers 0 --no-save --disable-validation --log-format json --log-interval 10"
)


def test_fairseq_command_line_runs_unchanged_and_builds_fairseqs_model(data_dir, capsys):
    argv = [data_dir if word == "DATA" else word for word in FAIRSEQ_COMMAND.split()]
    trainer = Trainer(parse_args(argv))
    # What fairseq builds from these flags: one embedding row per symbol of the data's
    # dictionary plus <mask>, and --tokens-per-sample 128 positions (+ fairseq's padding
    # offset of 2 rows), 2 layers of width 128 (test_fairseq_parameter_count_* checks the
    # same count against fairseq-fixed's own on a 16k dictionary):
    #   embeddings   V*128 + 130*128 + LayerNorm 2*128
    #   per layer    4*(128*128+128) attention + 2*128 LayerNorm
    #                + 128*512+512 + 512*128+128 + 2*128 LayerNorm = 198,272; two: 396,544
    #   LM head      128*128+128 dense + 2*128 LayerNorm + V bias (output tied to the embedding)
    rows = len(trainer.data.dictionary)
    assert trainer.model.embed_tokens.num_embeddings == rows and trainer.model.embed_positions.num_embeddings == 130
    assert sum(p.numel() for p in trainer.model.parameters()) == rows * 129 + 130 * 128 + 256 + 396_544 + 16_768
    config = trainer.model.config
    assert (config.n_layers, config.dim, config.ffn_dim, config.n_heads) == (2, 128, 512, 2)
    assert main(argv) == 0
    lines = log_lines(capsys)
    assert [line["update"] for line in lines if line["kind"] == "train"] == [1, 10, 20, 30, 40, 50]
    assert not any(line["kind"] == "valid" for line in lines)  # --disable-validation


def test_architecture_flags_are_checked_against_the_arch(capsys):
    with pytest.raises(Exception, match="--decoder-layers sizes a llama model, but --arch roberta_tiny"):
        Trainer(parse_args(["--arch", "roberta_tiny", "--decoder-layers", "2", "--no-save"]))


def test_fp16_on_a_cpu_is_refused_within_seconds_naming_bf16(capsys, monkeypatch, caplog):
    """The refusal rests on a timed matmul probe, fixed here to a CPU without fast fp16
    (20x slower than fp32) and to one with it (AVX512-FP16, AMX: as fast), so the test
    holds on either kind of machine."""
    rates = {"fp32": 100e9, "fp16": 5e9}
    monkeypatch.setattr(validation, "measure_cpu_matmul_flops", lambda dtype, **kwargs: rates[dtype])
    started = time.monotonic()
    assert main(["--fp16", "--device", "cpu", "--no-save"]) == 2
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "--bf16" in message[0] and "20 times slower than fp32" in message[0], message
    assert time.monotonic() - started < 10
    rates["fp16"] = 120e9
    with caplog.at_level(logging.INFO, logger="distlm"):
        validation.check_cpu_fp16_speed()  # no refusal, and the line says why
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "--fp16 on this CPU: allowed, an fp16 matrix multiply runs at 1.20x fp32's speed here"]


def saved_run(data: str, save_dir, extra=()) -> list[str]:
    args = [a for a in common_args(data, str(save_dir)) if a != "--no-save"]
    return args + ["--batch-size", "4", "--disable-validation", *extra]


def test_restore_file_and_the_reset_flags_keep_fairseqs_meaning(data_dir, tmp_path):
    first = tmp_path / "first"
    validated = [a for a in saved_run(data_dir, first, ["--max-update", "4", "--save-interval-updates", "2",
                                                       "--validate-interval-updates", "2"])
                 if a != "--disable-validation"]
    assert main(validated) == 0
    assert (first / "checkpoint_2").is_dir() and (first / "checkpoint_4").is_dir()
    saved = CheckpointReader(first / "checkpoint_2")
    weights = dict(saved.model_tensors())

    def resumed(name: str, *flags: str) -> Trainer:
        return Trainer(parse_args(saved_run(data_dir, tmp_path / name,
                                            ["--restore-file", str(first / "checkpoint_2"), *flags])))

    plain = resumed("plain")
    assert plain.resumed_at == 2 and plain.consumed_samples == 2 * 4
    assert plain.progress.best == saved.meta["progress"]["best"] is not None and plain.progress.train_wall > 0
    # fairseq: --reset-optimizer loads no optimizer state and restarts the update count,
    # keeps the data position, and forgets the best validation value.
    fresh_optimizer = resumed("reset_optimizer", "--reset-optimizer")
    assert fresh_optimizer.num_updates == 0 and not fresh_optimizer.optimizer.state
    assert fresh_optimizer.consumed_samples == 2 * 4 and fresh_optimizer.progress.best is None
    for name, param in fresh_optimizer.model.named_parameters():
        assert torch.equal(param.detach(), weights[name]), name  # the weights are still the checkpoint's
    # fairseq: --reset-lr-scheduler skips the scheduler's state only; the schedule is a
    # function of the update count, so the learning rate continues at update 3.
    continued = resumed("reset_lr", "--reset-lr-scheduler")
    assert continued.num_updates == 2 and continued.optimizer.state
    record = continued.train_step(next(continued.update_batches()))
    assert record["lr"] == pytest.approx(continued.schedule.lr_at(3), rel=1e-6)
    assert record["lr"] != pytest.approx(continued.schedule.lr_at(1), rel=1e-6)  # not a new warmup
    meters = resumed("reset_meters", "--reset-meters")
    assert meters.num_updates == 2 and meters.progress.train_wall == 0 and meters.progress.best is None
    assert resumed("reset_data", "--reset-dataloader").consumed_samples == 0
    with pytest.raises(UsageError, match="--restore-file .*: no checkpoint there"):
        Trainer(parse_args(saved_run(data_dir, tmp_path / "x", ["--restore-file", str(tmp_path / "nothing")])))


def test_finetune_from_model_takes_weights_only_and_yields_to_a_resume(data_dir, tmp_path):
    source = tmp_path / "source"
    assert main(saved_run(data_dir, source, ["--max-update", "2"])) == 0
    target = tmp_path / "target"
    args = saved_run(data_dir, target, ["--finetune-from-model", str(source / "checkpoint_last"), "--max-update", "3"])
    trainer = Trainer(parse_args(args))
    assert trainer.num_updates == 0 and trainer.consumed_samples == 0 and not trainer.optimizer.state
    for name, value in CheckpointReader(source).model_tensors():
        assert torch.equal(dict(trainer.model.named_parameters())[name].detach(), value), name
    trainer.fit()
    # With a checkpoint of its own in --save-dir, the same command resumes that instead.
    assert Trainer(parse_args(args)).resumed_at == 3


def test_no_last_checkpoints_writes_only_the_numbered_ones(data_dir, tmp_path):
    assert main(saved_run(data_dir, tmp_path, ["--max-update", "2", "--save-interval-updates", "2",
                                               "--no-last-checkpoints"])) == 0
    assert (tmp_path / "checkpoint_2").is_dir() and not (tmp_path / "checkpoint_last").exists()


def test_validation_on_a_traced_device_marks_a_step_per_batch_and_sums_in_float32(data_dir, tmp_path):
    """What --device xla's validation does, on CPU: a backend with static shapes gets a step
    marker after every batch (one graph per batch shape, not one for the split) and float32
    sums on the device. The loss is eager float64's within float32 summation error: 20
    batch sums of about 1e2 each, relative rounding 6e-8 per addition, far below 1e-5."""
    trainer = Trainer(parse_args(common_args(data_dir, str(tmp_path)) + ["--batch-size-valid", "1"]))
    marks = []

    class TracedCpu(type(trainer.ctx.backend)):
        static_shapes = True

        def mark_step(self) -> None:
            marks.append(len(marks))

    eager = trainer.validator
    traced_ctx = dataclasses.replace(trainer.ctx, backend=TracedCpu())
    traced = Validator(trainer.config, traced_ctx, eager.subsets, eager.compute_loss, eager.loss_context,
                       eager.local_loss, eager.autocast, pad_to=32, positions=eager.positions)
    assert (eager.sum_dtype, traced.sum_dtype) == (torch.float64, torch.float32)
    expected = eager.validate(trainer.model)[0]
    result = traced.validate(trainer.model)[0]
    assert len(marks) == len(eager.subsets["valid"]) == 14  # one per batch of one sample
    assert result.target_tokens == expected.target_tokens
    assert result.loss == pytest.approx(expected.loss, rel=1e-5)
