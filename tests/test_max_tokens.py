"""``--max-tokens``: batches within a token budget over length-bucketed samples, as fairseq's.

The batches come from one stream of (seed, epoch) alone; an update takes its next
``update_freq x ranks`` of them, so 2 ranks train as one process with twice the
``--update-freq`` on the same batches. The checks of the sampler run in this process; the
2-rank runs (straight, and stopped to be resumed on one process) share one job.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import Scenarios
from distlm import checkpoint
from distlm.checkpoint.compare import changed_settings
from distlm.config import check_settings, parse_args
from distlm.data import load_split
from distlm.data.batches import update_batches
from distlm.data.sampler import TokenBudgetSampler
from distlm.errors import UsageError
from distlm.training.trainer import Trainer

# 400 sentences of 4 to 29 inputs: 9 batches an epoch, so 2 batches an update cross
# into epoch 1 at update 5, and update 3 ends in the middle of epoch 0.
MAX_TOKENS = 1024


def args_for(data: str, save_dir: Path, max_update: int, extra: list[str] = ()) -> list[str]:
    return [
        "--data", data, "--arch", "llama_tiny", "--tokens-per-sample", "32", "--sample-break-mode", "eos",
        "--max-tokens", str(MAX_TOKENS), "--batch-size", "64", "--dropout", "0", "--lr", "1e-3",
        "--warmup-updates", "2", "--total-num-update", "10", "--adam-eps", "1e-6", "--max-update", str(max_update),
        "--log-interval", "1000", "--save-dir", str(save_dir), "--disable-validation", "--device", "cpu",
        "--seed", "3", *extra,
    ]


def fit(args: list[str]) -> dict:
    trainer = Trainer(parse_args(args))
    final = trainer.fit()
    return {**final, "resumed_at": trainer.resumed_at}


@pytest.fixture(scope="module")
def train_data(data_dir):
    return load_split(parse_args(args_for(data_dir, Path("unused"), 1)), "train", "causal_lm", None, None)


def sampler_for(data, max_tokens=MAX_TOKENS, batch_size=64, multiple=8, update_freq=1, rank=0, ranks=1, skip=False):
    return TokenBudgetSampler(data.sizes, max_tokens, batch_size, multiple, update_freq, rank, ranks, 3, skip)


@pytest.mark.parametrize("max_tokens,batch_size,multiple", [(1024, 64, 8), (200, 1000, 1), (96, 5, 3)])
def test_no_batch_above_the_budget_and_each_epoch_every_sample_once(train_data, max_tokens, batch_size, multiple):
    sampler = sampler_for(train_data, max_tokens, batch_size, multiple)
    orders = []
    for epoch in (0, 1):
        batches = sampler.batches(epoch)[0]
        # What the model is handed: the collated batches, padded to their longest sample.
        shapes = [tuple(batch["input_ids"].shape) for update in
                  _take(update_batches(train_data, sampler, epoch * sampler.num_samples, 1, 0), len(batches))
                  for batch in update]
        assert max(rows * width for rows, width in shapes) <= max_tokens
        assert max(rows for rows, _ in shapes) <= batch_size
        assert [rows for rows, _ in shapes] == [len(batch) for batch in batches]
        # fairseq's rule: rows are a multiple of --required-batch-size-multiple, but for
        # batches of fewer rows and the batch of the longest samples, where the cutting ends.
        longest_batch = max(range(len(batches)), key=lambda i: train_data.sizes[batches[i]].max())
        assert all(len(b) % multiple == 0 or len(b) < multiple for i, b in enumerate(batches) if i != longest_batch)
        order = np.concatenate(batches)
        assert sorted(order.tolist()) == list(range(len(train_data)))
        orders.append(order)
    assert not np.array_equal(*orders)  # shuffled by epoch
    if multiple == 1 and batch_size >= len(train_data):
        # Length buckets: padding within 20% where fixed batches of 8 pad about half.
        padded = sum(len(b) * train_data.sizes[b].max() for b in batches)
        assert train_data.sizes.sum() / padded > 0.8


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_two_ranks_take_the_one_process_stream_in_turn(train_data):
    one = sampler_for(train_data, update_freq=2)
    ranks = [sampler_for(train_data, rank=r, ranks=2) for r in (0, 1)]
    consumed = 0
    for _ in range(7):  # across the end of epoch 0 and into epoch 1
        expected = one.update_micro_batches(consumed, 0)
        assert [micro for sampler in ranks for micro in sampler.update_micro_batches(consumed, 0)] == expected
        assert one.samples_in_update(consumed) == ranks[1].samples_in_update(consumed) == sum(map(len, expected))
        # The k-th update from a start is the update at the start's position plus k.
        assert one.update_micro_batches(0, one.batch_position(consumed) // 2) == expected
        consumed += one.samples_in_update(consumed)
    assert one.epoch_of(consumed) == 1


def test_a_position_inside_a_batch_is_refused_in_one_line(train_data):
    sampler = sampler_for(train_data)
    inside = sampler.samples_in_update(0) - 1
    with pytest.raises(UsageError, match="falls inside a --max-tokens batch") as refused:
        sampler.update_micro_batches(inside, 0)
    assert "\n" not in str(refused.value)


def test_samples_longer_than_the_budget_are_refused_or_skipped(train_data):
    longest = int(train_data.sizes.max())
    too_long = int((train_data.sizes > 20).sum())
    with pytest.raises(UsageError) as refused:
        sampler_for(train_data, max_tokens=20)
    assert str(refused.value) == (
        f"{too_long} of the 400 training samples are longer than --max-tokens 20 (the longest has {longest} tokens): "
        f"raise --max-tokens to at least {longest}, or skip them with --skip-invalid-size-inputs-valid-test")
    skipping = sampler_for(train_data, max_tokens=20, skip=True)
    assert skipping.skipped == too_long and skipping.num_samples == 400 - too_long
    kept = np.concatenate(skipping.batches(0)[0])
    assert train_data.sizes[kept].max() <= 20 and len(kept) == 400 - too_long
    with pytest.raises(UsageError, match="without --max-tokens no sample is too long"):
        check_settings(parse_args(["--skip-invalid-size-inputs-valid-test"]))


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory) -> tuple[Path, Scenarios]:
    """2 ranks: 5 updates straight, and 3 to be resumed on one process."""
    root = tmp_path_factory.mktemp("max_tokens")
    return root, Scenarios(2, [
        ("straight", fit, (args_for(data_dir, root / "two", 5),)),
        ("stopped", fit, (args_for(data_dir, root / "two_to_one", 3),)),
    ], timeout=300)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> tuple[Path, dict]:
    """One process, --update-freq 2: the 2-rank runs' global batches, 5 updates."""
    root = tmp_path_factory.mktemp("max_tokens_reference")
    return root, fit(args_for(data_dir, root / "one", 5, ["--update-freq", "2"]))


# Tolerance: 2 ranks sum two batches' gradients in DDP's all-reduce where one process
# accumulates them, so parameters differ by fp32 reassociation, amplified by Adam for
# elements whose gradient is rounding noise (bounded by --adam-eps 1e-6); see
# tests/test_ddp.py. A wrong batch, a batch more or less, or a wrong normalisation moves
# parameters by ~1e-4 and more at --lr 1e-3.
PARAM_ATOL = 5e-6


def assert_close(a: dict, b: dict) -> None:
    assert a["num_updates"] == b["num_updates"] and a["consumed_samples"] == b["consumed_samples"]
    for name, value in a["model"].items():
        torch.testing.assert_close(value, b["model"][name], rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")


def test_two_ranks_equal_one_process_on_the_same_batches(runs, reference, train_data):
    root, ranks = runs
    one_root, one = reference
    assert_close(checkpoint.load(root / "two" / checkpoint.LAST), checkpoint.load(one_root / "one" / checkpoint.LAST))
    two = ranks["straight"][0]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    # The runs crossed into epoch 1, at update 5, and the log counts real samples and tokens:
    # the summary covers updates 2 to 5 (update 1 has its own line).
    sampler = sampler_for(train_data, update_freq=2)
    assert one["consumed_samples"] > sampler.num_samples
    first = sampler.samples_in_update(0)
    batches = [b for k in range(1, 5) for b in sampler.update_micro_batches(0, k)]
    real = sum(int(train_data.sizes[[i for _, i in b]].sum()) for b in batches)
    padded = sum(len(b) * int(train_data.sizes[[i for _, i in b]].max()) for b in batches)
    for summary in (one, two):
        assert summary["bsz"] == (one["consumed_samples"] - first) / 4
        assert summary["padding"] == pytest.approx(1 - real / padded, abs=1e-4)


def test_resume_mid_epoch_from_two_ranks_on_one_process(runs, reference, data_dir, tmp_path):
    root, ranks = runs
    one_root, one = reference
    stopped = checkpoint.load(root / "two_to_one" / checkpoint.LAST)
    assert stopped["num_updates"] == 3 and 0 < stopped["consumed_samples"] < 400  # mid-epoch
    # Exact on one process: 3 updates, a resume, and 2 more equal 5 straight, bit for bit.
    assert fit(args_for(data_dir, tmp_path / "one", 3, ["--update-freq", "2"]))["resumed_at"] is None
    assert fit(args_for(data_dir, tmp_path / "one", 5, ["--update-freq", "2"]))["resumed_at"] == 3
    exact, straight = checkpoint.load(tmp_path / "one" / checkpoint.LAST), checkpoint.load(one_root / "one" / checkpoint.LAST)
    for name, value in straight["model"].items():
        assert torch.equal(exact["model"][name], value), name
    assert exact["consumed_samples"] == straight["consumed_samples"]
    # From 2 ranks to 1: the same batches follow, so it ends where one process straight does.
    shutil.copytree(root / "two_to_one", tmp_path / "two_to_one")
    assert fit(args_for(data_dir, tmp_path / "two_to_one", 5, ["--update-freq", "2"]))["resumed_at"] == 3
    assert_close(checkpoint.load(tmp_path / "two_to_one" / checkpoint.LAST), straight)


def test_a_resume_at_another_world_size_says_the_update_in_batches():
    data = {"batch_size": 64, "update_freq": 1, "max_tokens": 1024}
    line = changed_settings({"data": data}, {"data": data}, 2, 1, 812, 3)
    assert line == ("resuming with global batch 2 --max-tokens batches → 1 --max-tokens batches; the data position "
                    "carries over as 812 samples consumed: the next update reads on from sample 812 of the same "
                    "order, 1 --max-tokens batches per update")


# ------------------------------------------------------------------- --max-tokens-valid

def validation_shapes(trainer: Trainer) -> tuple[float, list[tuple[int, int]]]:
    """The validation loss, and the shapes of the batches it was computed on."""
    shapes, compute = [], trainer.validator.compute_loss

    def recording(batch):
        shapes.append(tuple(batch["input_ids"].shape))
        return compute(batch)

    trainer.validator.compute_loss = recording
    return trainer.validator.validate(trainer.model)[0].loss, shapes


def valid_args(data_dir, *extra: str) -> list[str]:
    return ["--data", data_dir, "--arch", "llama_tiny", "--tokens-per-sample", "32", "--sample-break-mode", "eos",
            "--batch-size", "64", "--no-save", "--device", "cpu", "--decoder-layers", "1", *extra]


def test_max_tokens_valid_batches_validation_by_its_budget_to_the_same_loss(data_dir, train_data):
    by_rows, row_shapes = validation_shapes(Trainer(parse_args(valid_args(data_dir, "--batch-size-valid", "3"))))
    assert len(row_shapes) == 7  # 20 samples, 3 a batch
    # The budget defaults to --max-tokens, and --max-tokens-valid overrides it.
    for extra in (["--max-tokens", "1024", "--max-tokens-valid", "96"], ["--max-tokens", "96"]):
        loss, shapes = validation_shapes(Trainer(parse_args(valid_args(data_dir, "--required-batch-size-multiple",
                                                                       "1", *extra))))
        assert max(rows * width for rows, width in shapes) <= 96 and sum(rows for rows, _ in shapes) == 20
        # Every sample once, in other batches: the loss over the split is the same but for rounding.
        assert loss == pytest.approx(by_rows, rel=1e-6)


def test_validation_samples_longer_than_the_budget_are_refused_or_skipped(data_dir, caplog):
    with pytest.raises(UsageError) as refused:
        Trainer(parse_args(valid_args(data_dir, "--max-tokens-valid", "20")))
    sizes = load_split(parse_args(valid_args(data_dir)), "valid", "causal_lm", None).sizes
    assert str(refused.value) == (
        f"{int((sizes > 20).sum())} of the 20 samples of validation split valid are longer than --max-tokens-valid 20 "
        f"(the longest has {sizes.max()} tokens): raise --max-tokens-valid to at least {sizes.max()}, or skip them "
        "with --skip-invalid-size-inputs-valid-test")
    trainer = Trainer(parse_args(valid_args(data_dir, "--max-tokens-valid", "20", "--skip-invalid-size-inputs-valid-test")))
    loss, shapes = validation_shapes(trainer)
    assert max(width for _, width in shapes) <= 20 and 0 < sum(rows for rows, _ in shapes) < 20


def test_max_tokens_valid_splits_the_split_between_ranks_every_sample_once(data_dir):
    """Rank r cuts its every-dp-th share of the split into budget batches; the ranks with fewer
    batches run empty ones until the rank with the most is done (see Validator._subset)."""
    from types import SimpleNamespace

    from distlm.training.evaluation import Validator

    config = parse_args(valid_args(data_dir, "--max-tokens-valid", "96", "--required-batch-size-multiple", "1"))
    data = load_split(config, "valid", "causal_lm", None)
    ctx = SimpleNamespace(dims=SimpleNamespace(dp=2), dp_rank=0, is_main=False,
                          backend=SimpleNamespace(static_shapes=False))
    validator = Validator(config, ctx, {"valid": data}, None, None, None, None)
    ranks = validator._token_batches["valid"]
    assert len(ranks) == 2
    for rank, batches in enumerate(ranks):
        assert sorted(np.concatenate(batches).tolist()) == list(range(rank, 20, 2))
        assert max(len(batch) * int(data.sizes[batch].max()) for batch in batches) <= 96
