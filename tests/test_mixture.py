"""--data 0.3:A 0.7:B mixes directories by weight: each source's share of a run follows its
weight, the sample sequence is the same on any world size and resumes exactly from the
consumed-sample count, and bad weights or vocabularies are one line."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from distlm.runtime.agreement import fingerprint_data
from distlm.config import parse_args
from distlm.data import GlobalBatchSampler, MMapIndexedDataset, load_split, write_indexed_dataset
from distlm.data.batches import training_sampler
from distlm.errors import UsageError
from distlm.train import main
from distlm.training.trainer import Trainer
from test_resume import args_for, assert_identical, final_state, fit

WORDS = 30  # ids 4-33; each source writes its own tenth of them, so a sample names its source
SIZES = {"a": 300, "b": 100, "c": 60}


def write_source(root: Path, source: int, sentences: int, words: int = WORDS) -> str:
    root.mkdir()
    (root / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(words)))
    rng = np.random.default_rng(source)
    low = 4 + 10 * source
    # One sentence per sample (eos break mode): a sample of source s is s's sentence.
    data = [np.append(rng.integers(low, low + 10, size=rng.integers(5, 15)), 2) for _ in range(sentences)]
    write_indexed_dataset(str(root / "train"), data, np.uint16)
    write_indexed_dataset(str(root / "valid"), data[:10], np.uint16)
    return str(root)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("mixture")
    return {name: write_source(base / name, index, size) for index, (name, size) in enumerate(SIZES.items())}


def mixture_args(sources: dict[str, str], weights: dict[str, float], *extra: str) -> list[str]:
    return ["--data", *(f"{weights[name]}:{sources[name]}" for name in weights), "--arch", "llama_tiny",
            "--tokens-per-sample", "16", "--sample-break-mode", "eos", "--batch-size", "4", "--device", "cpu", *extra]


def source_of(inputs: np.ndarray) -> int:
    """Which source wrote a sample, from its words."""
    return (int(inputs[inputs >= 4][0]) - 4) // 10


def stream(config, consumed: int, updates: int, world_size: int) -> list[np.ndarray]:
    """The input ids of the global batches after ``consumed`` samples, as ``world_size`` ranks
    (each with its own freshly loaded data, as in its own process) read them, rank after rank."""
    batches = []
    for rank in range(world_size):
        data = load_split(config, "train", "causal_lm", None)
        sampler = GlobalBatchSampler(len(data), micro_batch_size=4, update_freq=2 // world_size, dp_rank=rank,
                                     dp_size=world_size, seed=config.seed)
        batches.append([[data.sample(*pair)[0] for batch in sampler.local_micro_batches(position) for pair in batch]
                        for position in range(consumed, consumed + updates * sampler.global_batch_size,
                                              sampler.global_batch_size)])
    # Update k's global batch: rank 0's slice, then rank 1's.
    return [sample for update in zip(*batches) for part in update for sample in part]


def test_each_sources_share_of_a_run_is_within_a_binomial_bound_of_its_weight(sources):
    weights = {"a": 0.2, "b": 0.5, "c": 0.3}
    config = parse_args(mixture_args(sources, weights))
    data = load_split(config, "train", "causal_lm", None)
    epoch = sum(SIZES.values())
    assert len(data) == epoch and data.index.counts == [92, 230, 138]  # each weight's share of an epoch of 460
    sampler = GlobalBatchSampler(len(data), 4, 1, 0, 1, seed=1)
    n = 2 * epoch + 157  # over two epochs and part of a third
    drawn = [data.sample(*pair)[0] for pair in sampler.samples_at(np.arange(n))]
    counts = np.bincount([source_of(inputs) for inputs in drawn], minlength=3)
    assert data.index.drawn(n, sampler.permutation) == counts.tolist()  # what validation lines report
    for (name, weight), count in zip(weights.items(), counts):
        # 4 standard deviations of a binomial(n, weight) share: a weighted random draw of n
        # samples would leave it with probability 6e-5. The stream is tighter than that
        # (each whole epoch holds the apportioned counts exactly), so this cannot pass by luck
        # for a rule that ignores the weights: equal thirds would be 15 deviations off for a.
        bound = 4 * math.sqrt(weight * (1 - weight) / n)
        assert abs(count / n - weight) <= bound, (name, count / n, weight, bound)
    # Source a, drawn 92 times an epoch from 300 samples, sees another subset each epoch;
    # source b, drawn 230 times from 100, goes through all of its samples twice or three times.
    seen = [{data.index.locate(e, i) for i in range(epoch)} for e in range(2)]
    assert seen[0] != seen[1]
    draws_of_b = np.bincount([data.index.locate(0, i)[1] for i in range(epoch) if data.index.locate(0, i)[0] == 1], minlength=100)
    assert set(draws_of_b.tolist()) == {2, 3}


def test_an_unshuffled_prefix_holds_each_source_in_its_share(sources):
    # Validation reads the mixture in order: its first batches must not be one source alone.
    config = parse_args(mixture_args(sources, {"a": 1, "b": 1}))
    data = load_split(config, "valid", "causal_lm", None)  # valid: by size, 10 and 10
    assert [data.index.locate(0, i)[0] for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert sorted(data.index.locate(0, i) for i in range(len(data))) == [(s, i) for s in (0, 1) for i in range(10)]


def test_the_sample_sequence_is_the_same_on_one_and_two_ranks_and_resumes_exactly(sources):
    config = parse_args(mixture_args(sources, {"a": 0.3, "c": 0.7}))  # an epoch of 360 samples
    whole = stream(config, 0, 50, world_size=1)  # 400 samples: past the end of the first epoch
    assert [inputs.tolist() for inputs in stream(config, 0, 50, world_size=2)] == [inputs.tolist() for inputs in whole]
    # Resumed from the consumed count alone, on another world size, across the epoch's end.
    for consumed, world_size in ((352, 2), (200, 1)):
        resumed = stream(config, consumed, (400 - consumed) // 8, world_size)
        assert [inputs.tolist() for inputs in resumed] == [inputs.tolist() for inputs in whole[consumed:]]
    assert {source_of(inputs) for inputs in whole} == {0, 2}


def test_a_run_on_a_mixture_resumes_exactly(sources, tmp_path):
    mixture = f"0.3:{sources['a']} 0.7:{sources['b']}"
    assert fit(args_for(mixture, tmp_path / "straight", 4)) is None
    assert fit(args_for(mixture, tmp_path / "stopped", 2)) is None
    assert fit(args_for(mixture, tmp_path / "stopped", 4)) == 2
    assert_identical(final_state(tmp_path / "stopped"), final_state(tmp_path / "straight"))


def test_a_run_on_a_mixture_logs_each_sources_share_size_and_training_samples(sources, tmp_path, caplog, capsys):
    args = mixture_args(sources, {"a": 0.25, "b": 0.75}, "--max-update", "3", "--no-save", "--save-dir",
                        str(tmp_path), "--log-format", "json")
    with caplog.at_level(logging.INFO, logger="distlm"):
        trainer = Trainer(parse_args(args))
        trainer.fit()
    assert (trainer.num_updates, trainer.consumed_samples) == (3, 12)
    assert f"data source {sources['a']}: weight 0.25, 100 of each epoch's 400 samples (25.0%), 300 samples" in caplog.text
    assert f"data source {sources['b']}: weight 0.75, 300 of each epoch's 400 samples (75.0%), 100 samples" in caplog.text
    # The training samples of each source so far, with its validation line: as the 12 samples
    # the run read say by their words.
    sampler = GlobalBatchSampler(len(trainer.data), 4, 1, 0, 1, seed=1)
    read = np.bincount([source_of(trainer.data.sample(*pair)[0]) for pair in sampler.samples_at(np.arange(12))],
                       minlength=2)
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"kind": "valid"' in line]
    assert {r["subset"]: r.get("train_samples") for r in records} == {
        "valid": None, "valid/a": int(read[0]), "valid/b": int(read[1])}


@pytest.mark.parametrize("data, expected", [
    (["x:A", "1:B"], "--data source 'x:A': weight 'x' is not a number; write it as 0.3:A"),
    (["nan:A", "1:B"], "--data source 'nan:A': weight 'nan' is not a number; write it as 0.3:A"),
    (["1:A", "B"], "--data source 'B' is not WEIGHT:DIR; write a mixture as --data 0.3:A 0.7:B"),
    (["0:A", "0.0:B"], "--data '0:A 0.0:B': the weights sum to 0; give at least one source a positive weight"),
    # A negative weight reads as a flag on the command line; a TOML list can hold one.
    (["-1:A", "1:B"], "--data source '-1:A': weight -1 is negative; weights must be 0 or more"),
])
def test_bad_weights_are_one_line(data, expected, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(f"[data]\ndata = {data!r}\n".replace("'", '"'))
    for argv in (["--data", *data], ["--config", str(toml)]):
        if argv[1].startswith("-"):
            continue
        with pytest.raises(UsageError) as error:
            parse_args(argv)
        assert str(error.value) == expected


def test_bad_weights_exit_with_status_2(capsys):
    assert main(["--data", "0:A", "0:B", "--device", "cpu"]) == 2
    assert "the weights sum to 0" in capsys.readouterr().err


def test_sources_with_different_vocabularies_are_refused_naming_both(sources, tmp_path):
    other = write_source(tmp_path / "other", 0, 20, words=WORDS + 1)
    config = parse_args(mixture_args({"a": sources["a"], "o": other}, {"a": 1, "o": 1}))
    with pytest.raises(UsageError) as error:
        load_split(config, "train", "causal_lm", None)
    assert str(error.value) == (
        f"--data sources {sources['a']} and {other} have different vocabularies ({sources['a']}/dict.txt: 34 symbols "
        f"vs {other}/dict.txt: 35 symbols); a mixture needs one: prepare every source with the same dictionary or tokenizer")


def test_a_plain_directory_and_a_toml_list_both_still_read(sources, tmp_path):
    assert parse_args(["--data", sources["a"]]).data.data == sources["a"]
    assert parse_args([sources["a"]]).data.data == sources["a"]
    toml = tmp_path / "run.toml"
    toml.write_text(f'[data]\ndata = ["0.3:{sources["a"]}", "0.7:{sources["b"]}"]\n')
    assert parse_args(["--config", str(toml)]).data.data == f"0.3:{sources['a']} 0.7:{sources['b']}"
    toml.write_text('[data]\ndata = [0.3, "A"]\n')
    with pytest.raises(UsageError, match=r"a mixture is a list of \"WEIGHT:DIR\" strings"):
        parse_args(["--config", str(toml)])


def test_the_data_fingerprint_of_a_mixture_follows_contents_and_weights(sources, tmp_path):
    copy = shutil.copytree(sources["b"], tmp_path / "b copy")
    mixture = f"0.3:{sources['a']} 0.7:{sources['b']}"
    same = parse_args(["--data", f"0.3:{sources['a']}", f"0.7:{copy}"]).data.data  # a path with a space
    assert fingerprint_data(same) == fingerprint_data(mixture)  # the same files under another path
    assert fingerprint_data(f"0.4:{sources['a']} 0.6:{sources['b']}") != fingerprint_data(mixture)
    assert fingerprint_data(f"0.3:{sources['a']} 0.7:{sources['c']}") != fingerprint_data(mixture)
    assert fingerprint_data(f"0.3:{sources['a']} 0.7:{tmp_path / 'missing'}") == "no such directory"


def test_each_source_is_validated_on_its_own_and_the_split_is_their_token_weighted_loss(sources, tmp_path):
    def results(data: str) -> dict[str, tuple[float, int]]:
        trainer = Trainer(parse_args(["--data", data, "--arch", "llama_tiny", "--tokens-per-sample", "16",
                                      "--batch-size", "4", "--device", "cpu", "--no-save", "--save-dir", str(tmp_path)]))
        return {r.subset: (r.loss, r.target_tokens) for r in trainer.validator.validate(trainer.model)}

    mixed = results(f"0.9:{sources['a']} 0.1:{sources['b']}")
    assert list(mixed) == ["valid", "valid/a", "valid/b"]
    # The same freshly initialised model (same seed, same vocabulary) on source a alone: the
    # same batches, so the same sums, exactly.
    assert mixed["valid/a"] == results(sources["a"])["valid"]
    # The split's loss is over every held-out token once, whatever the training weights: as
    # one directory holding both sources' valid sentences gives it. Batched differently, the
    # float32 forward passes differ by rounding only (well under 1e-5 of the loss), while the
    # sources' losses differ by about 0.3%: weighing them 0.9/0.1 would be 1e-3 off.
    both = tmp_path / "both"
    both.mkdir()
    shutil.copy(Path(sources["a"]) / "dict.txt", both / "dict.txt")
    sentences = [MMapIndexedDataset(Path(sources[name]) / "valid")[i] for name in "ab" for i in range(10)]
    for split in ("train", "valid"):
        write_indexed_dataset(str(both / split), sentences, np.uint16)
    loss, tokens = results(str(both))["valid"]
    assert mixed["valid"][1] == tokens == mixed["valid/a"][1] + mixed["valid/b"][1]
    assert mixed["valid"][0] == pytest.approx(loss, rel=1e-5)


def test_a_mixture_packs_with_document_masks_as_each_source_does(sources):
    """--document-mask over a mixture: each sample's document ids and its first-token targets
    are those its own source gives it."""
    config = parse_args(mixture_args(sources, {"a": 0.5, "b": 0.5}, "--sample-break-mode", "none",
                                     "--document-mask", "--no-save"))
    mixture = load_split(config, "train", "causal_lm", None)
    pairs = [(0, index) for index in range(6)]
    batch = mixture.collate(pairs)
    for row, (epoch, index) in enumerate(pairs):
        source, inner = mixture.index.locate(epoch, index)
        own = mixture.sources[source]
        inputs, targets = own.sample(epoch, inner)
        assert np.array_equal(batch["input_ids"][row, :len(inputs)].numpy(), inputs)
        assert np.array_equal(batch["targets"][row, :len(targets)].numpy(), targets)
        assert np.array_equal(batch["document_ids"][row, :len(inputs)].numpy(), own.document_ids(epoch, inner)[:-1])
    assert (batch["targets"] == -100).any()  # some sample holds a document start, which predicts nothing


# ------------------------------------------------------------ --max-tokens over a mixture

def token_sampler(sources, update_freq: int, rank: int = 0, ranks: int = 1, *extra: str):
    config = parse_args(mixture_args(sources, {"a": 0.3, "c": 0.7}, "--max-tokens", "64",
                                     "--update-freq", str(update_freq), *extra))
    data = load_split(config, "train", "causal_lm", None)
    return data, training_sampler(config, data, rank, ranks, None, False)


def test_max_tokens_batches_a_mixture_within_the_budget_each_epoch_every_index_once(sources):
    data, sampler = token_sampler(sources, 1)
    sizes = {}
    for epoch in (0, 1):
        sizes[epoch] = data.sizes_in_epoch(epoch)
        # The lengths the batches are cut by are those of the samples each index is that epoch.
        assert sizes[epoch].tolist() == [len(data.sample(epoch, i)[0]) for i in range(len(data))]
        batches = sampler.batches(epoch)[0]
        assert sorted(np.concatenate(batches).tolist()) == list(range(len(data)))
        assert max(len(batch) * int(sizes[epoch][batch].max()) for batch in batches) <= 64
    # Source c (60 samples) is drawn 252 times an epoch, a (300) 108 times: another subset
    # each epoch, so the epochs' lengths differ and each is cut on its own.
    assert sorted(sizes[0]) != sorted(sizes[1])
    assert sampler.updates_in_epochs(2) == len(sampler.batches(0)[0]) + len(sampler.batches(1)[0])


def test_max_tokens_over_a_mixture_is_one_stream_on_one_and_two_ranks_and_resumes_exactly(sources):
    _, one = token_sampler(sources, 2)
    ranks = [token_sampler(sources, 1, rank, 2)[1] for rank in (0, 1)]
    consumed, positions = 0, []
    while one.epoch_of(consumed) < 1 or len(positions) < 3 + one.num_batches // 2:  # into epoch 1
        expected = one.update_micro_batches(consumed, 0)
        assert [micro for sampler in ranks for micro in sampler.update_micro_batches(consumed, 0)] == expected
        positions.append((consumed, expected))
        consumed += one.samples_in_update(consumed)
    # A fresh sampler (a resumed run) at another world size continues from the count alone,
    # in epoch 1 too, whose batches come after epoch 0's however many those were.
    for consumed, expected in positions[-3:]:
        resumed = [token_sampler(sources, 1, rank, 2)[1] for rank in (0, 1)]
        assert [micro for sampler in resumed for micro in sampler.update_micro_batches(consumed, 0)] == expected


def test_a_mixtures_training_counts_follow_the_token_batches(sources):
    data, sampler = token_sampler(sources, 2)
    consumed = 0
    read = np.zeros(2, dtype=int)
    while consumed < len(data) + 20:  # into the second epoch
        for batch in sampler.update_micro_batches(consumed, 0):
            for epoch, index in batch:
                read[data.index.locate(epoch, index)[0]] += 1
        consumed += sampler.samples_in_update(consumed)
    assert sampler.epoch_of(consumed) == 1
    assert list(data.drawn(consumed, sampler.permutation).values()) == read.tolist()


def test_a_mixture_refuses_samples_longer_than_the_budget_in_one_line(sources):
    config = parse_args(mixture_args(sources, {"a": 0.3, "c": 0.7}, "--max-tokens", "8",
                                     "--skip-invalid-size-inputs-valid-test"))
    data = load_split(config, "train", "causal_lm", None)
    longest = int(data.drawn_sizes.max())
    with pytest.raises(UsageError, match=rf"mixture cannot skip them .* raise --max-tokens to at least {longest}$") \
            as refused:
        training_sampler(config, data, 0, 1, None, False)
    assert "\n" not in str(refused.value)


def test_a_run_on_a_mixture_trains_and_validates_with_max_tokens(sources, tmp_path, capsys):
    args = mixture_args(sources, {"a": 0.3, "c": 0.7}, "--max-tokens", "64", "--max-update", "2", "--no-save",
                        "--save-dir", str(tmp_path), "--log-format", "json")
    trainer = Trainer(parse_args(args))
    trainer.fit()
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"kind": "valid"' in line]
    drawn = [r["train_samples"] for r in records if "train_samples" in r]
    assert len(drawn) == 2 and sum(drawn) == trainer.consumed_samples > 0
