"""Built-in corpus, dictionary, tokenizer, blocks, masking, sampling and collation."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distlm.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    Dictionary,
    DynamicMasker,
    GlobalBatchSampler,
    MMapIndexedDataset,
    TokenBlockDataset,
    byte_dictionary,
    compute_block_boundaries,
    load_lm_data,
    write_indexed_dataset,
)
from distlm.data import corpus
from distlm.data.tokenizer import write_hf_tokenizer
from distlm.errors import UsageError

REPO_ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------- built-in corpus

_BUILD_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
from distlm.data.corpus import ensure_builtin_corpus
print(ensure_builtin_corpus())
"""


@pytest.fixture(scope="module")
def concurrent_build(tmp_path_factory):
    """Build the real corpus once, by two processes racing for it as torchrun's ranks would."""
    cache = tmp_path_factory.mktemp("distlm_cache")
    python_path = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "DISTLM_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(python_path)}
    command = [sys.executable, "-c", _BUILD_SCRIPT]
    processes = [
        subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        results.append((process.returncode, stdout.strip(), stderr))
    return cache, results


@pytest.fixture(scope="module")
def corpus_dir(concurrent_build):
    cache, results = concurrent_build
    assert all(code == 0 for code, _, _ in results), [stderr for _, _, stderr in results]
    return Path(results[0][1])


@pytest.fixture
def builtin_cache_env(concurrent_build, monkeypatch):
    monkeypatch.setenv("DISTLM_CACHE_DIR", str(concurrent_build[0]))


def test_concurrent_builders_end_with_one_valid_cache(concurrent_build):
    cache, results = concurrent_build
    assert [code for code, _, _ in results] == [0, 0], [stderr for _, _, stderr in results]
    paths = {stdout for _, stdout, _ in results}
    assert len(paths) == 1
    built = Path(paths.pop())
    # Exactly one process built; the other waited on the lock and found it done.
    building_logs = sum(stderr.count("building the built-in corpus") for _, _, stderr in results)
    assert building_logs == 1
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [built.name]
    for name in corpus.CORPUS_FILES:
        assert (built / name).is_file()


def test_corpus_is_several_megabytes_of_english(corpus_dir):
    stats = json.loads((corpus_dir / corpus.STATS_FILE).read_text())
    assert stats["text_bytes"] >= 2_000_000
    dictionary = Dictionary.load(corpus_dir / "dict.txt")
    tokenizer = ByteTokenizer(dictionary)
    train = MMapIndexedDataset(corpus_dir / "train")
    assert train.num_tokens == stats["train"]["tokens"]
    assert len(train) == stats["train"]["sentences"]

    tokens = np.concatenate([train[i] for i in range(len(train))])
    # Every sentence ends with </s>, and </s> appears nowhere else.
    ends = np.cumsum(train.sizes) - 1
    assert (tokens[ends] == dictionary.eos()).all()
    assert (tokens == dictionary.eos()).sum() == len(train)

    text = tokenizer.decode(tokens)
    letters_and_spaces = sum(char.isascii() and (char.isalpha() or char == " ") for char in text)
    assert letters_and_spaces / len(text) > 0.75
    common_words = [" the ", " of ", " is ", " and ", " to "]
    assert all(text.count(word) > 5000 for word in common_words)


def test_corpus_holds_out_a_small_validation_split(corpus_dir):
    train = MMapIndexedDataset(corpus_dir / "train")
    valid = MMapIndexedDataset(corpus_dir / "valid")
    fraction = len(valid) / (len(train) + len(valid))
    assert 0.01 <= fraction <= 0.02
    train_sentences = {train[i].tobytes() for i in range(len(train))}
    assert not any(valid[i].tobytes() in train_sentences for i in range(len(valid)))


def test_paragraph_extraction_is_deterministic():
    first = list(itertools.islice(corpus.iter_stdlib_paragraphs(), 1500))
    second = list(itertools.islice(corpus.iter_stdlib_paragraphs(), 1500))
    assert first == second
    assert {source for source, _ in first} <= {"docstrings", "comments", "pydoc_topics"}


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("DISTLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpus.cache_root() == tmp_path / "xdg" / "distlm"
    monkeypatch.setenv("DISTLM_CACHE_DIR", str(tmp_path / "mine"))
    assert corpus.cache_root() == tmp_path / "mine"
    name = corpus.builtin_corpus_dir().name
    assert f"v{corpus.CORPUS_FORMAT_VERSION}" in name and "py{}.{}".format(*sys.version_info[:2]) in name


def test_load_builtin_corpus_reads_the_cache_without_rebuilding(builtin_cache_env, monkeypatch):
    def rebuilt(*args, **kwargs):
        raise AssertionError("the cached corpus was built again")

    monkeypatch.setattr(corpus, "_build", rebuilt)
    monkeypatch.setattr(corpus, "iter_stdlib_paragraphs", rebuilt)
    data = load_lm_data(None, "train", "masked_lm", tokens_per_sample=512)
    assert len(data) > 1000
    assert data.dictionary.symbols[-1] == "<mask>"
    batch = data.collate([(0, 0), (0, 1)])
    assert batch["input_ids"].shape[1] <= 512


# --------------------------------------------------------------------- dictionary


def test_dictionary_specials_and_symbols():
    dictionary = Dictionary()
    assert (dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk()) == (0, 1, 2, 3)
    assert dictionary.nspecial == 4 and len(dictionary) == 4
    assert dictionary.add_symbol("hello") == 4
    assert dictionary.add_symbol("hello") == 4
    assert dictionary.index("hello") == 4
    assert dictionary.index("never-seen") == dictionary.unk()
    with pytest.raises(UsageError, match="<mask>"):
        dictionary.mask()
    assert dictionary.add_symbol("<mask>") == 5 == dictionary.mask()
    assert dictionary.special_indices() == [0, 1, 2, 3, 5]


def test_dictionary_load_save_round_trip(tmp_path):
    (tmp_path / "dict.txt").write_text("the 120\nof 80\n<0x41> 3\n, 7\n")
    dictionary = Dictionary.load(tmp_path / "dict.txt")
    assert dictionary.symbols == ["<s>", "<pad>", "</s>", "<unk>", "the", "of", "<0x41>", ","]
    assert dictionary.counts[4:] == [120, 80, 3, 7]
    dictionary.save(tmp_path / "again.txt")
    assert (tmp_path / "again.txt").read_text() == (tmp_path / "dict.txt").read_text()
    assert Dictionary.load(tmp_path / "again.txt") == dictionary


def test_dictionary_overwrite_flag(tmp_path):
    (tmp_path / "dict.txt").write_text("a 5\n</s> 9 #fairseq:overwrite\nb 1 #fairseq:overwrite\n")
    dictionary = Dictionary.load(tmp_path / "dict.txt")
    assert dictionary.symbols == ["<s>", "<pad>", "</s>", "<unk>", "a", "b"]
    assert dictionary.counts[dictionary.eos()] == 9


@pytest.mark.parametrize(
    "content,expected",
    [("the 12\nof x\n", "line 2"), ("the 1\nthe 2\n", "duplicate"), ("lonely\n", "line 1")],
)
def test_garbled_dictionary_raises_usage_error_naming_file(tmp_path, content, expected):
    path = tmp_path / "dict.txt"
    path.write_text(content)
    with pytest.raises(UsageError, match=expected) as info:
        Dictionary.load(path)
    assert str(path) in str(info.value)


def test_missing_dictionary(tmp_path):
    with pytest.raises(UsageError, match="dict.txt"):
        Dictionary.load(tmp_path / "dict.txt")


def test_dictionary_from_symbols():
    original = byte_dictionary()
    original.add_symbol("<mask>")
    rebuilt = Dictionary.from_symbols(list(original.symbols))
    assert rebuilt == original and rebuilt.mask() == original.mask()
    with pytest.raises(UsageError):
        Dictionary.from_symbols(["a", "b"])


# ---------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trip(tmp_path):
    dictionary = byte_dictionary()
    dictionary.save(tmp_path / "dict.txt")
    tokenizer = ByteTokenizer(Dictionary.load(tmp_path / "dict.txt"))
    text = "Hello, world!\n\tnaïve café — 東京 🐍 \x00end"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(4 <= i < 260 for i in ids)
    assert tokenizer.decode(ids) == text
    # Specials carry no text.
    assert tokenizer.decode([dictionary.bos(), *ids, dictionary.eos(), dictionary.pad()]) == text


def test_byte_tokenizer_follows_dictionary_order_not_byte_order():
    symbols = ["<s>", "<pad>", "</s>", "<unk>"] + [f"<0x{v:02X}>" for v in reversed(range(256))]
    tokenizer = ByteTokenizer(Dictionary.from_symbols(symbols))
    assert tokenizer.encode("A") == [4 + 255 - 0x41]
    assert tokenizer.decode(tokenizer.encode("round trip")) == "round trip"


def test_byte_tokenizer_needs_byte_symbols(tmp_path):
    (tmp_path / "dict.txt").write_text("the 3\nof 2\n")
    with pytest.raises(UsageError, match="byte"):
        ByteTokenizer(Dictionary.load(tmp_path / "dict.txt"))


def pipeline_document(tmp_path: Path, text: str, task: str) -> tuple[list[int], Dictionary]:
    """The ids distlm trains on for ``text`` as one document, read back from a collated batch."""
    directory = tmp_path / task
    directory.mkdir()
    dictionary = byte_dictionary()
    dictionary.save(directory / "dict.txt")
    write_indexed_dataset(directory / "train", [ByteTokenizer(dictionary).encode(text) + [dictionary.eos()]])
    data = load_lm_data(directory, "train", task, tokens_per_sample=512, sample_break_mode="eos")
    batch = data.collate([(0, 0)])
    inputs, targets = batch["input_ids"][0], batch["targets"][0]
    if task == "masked_lm":  # the original sample: targets where chosen, inputs elsewhere
        return torch.where(targets != IGNORE_INDEX, targets, inputs).tolist(), data.dictionary
    return inputs.tolist() + targets[-1:].tolist(), data.dictionary


@pytest.mark.parametrize("task", ["masked_lm", "causal_lm"])
def test_byte_tokenizer_exports_as_a_hugging_face_tokenizer(tmp_path, task):
    transformers = pytest.importorskip("transformers")
    texts = [
        "Plain ASCII, with punctuation: (a, b) -> c.",
        "naïve café — 東京 🐍 \x00",
        "first paragraph\n\n\nafter blank lines\n\t tab",
        "typed specials stay text: <s> </s> <mask> <pad>",
    ]
    dictionary = pipeline_document(tmp_path, "x", task)[1]
    write_hf_tokenizer(dictionary, tmp_path / "hf", task)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert len(tokenizer) == len(dictionary)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (dictionary.pad(), dictionary.eos())
    if task == "masked_lm":
        assert tokenizer.mask_token_id == dictionary.mask()
    for number, text in enumerate(texts):
        case_dir = tmp_path / f"text{number}"
        case_dir.mkdir()
        expected, _ = pipeline_document(case_dir, text, task)
        ids = tokenizer(text)["input_ids"]
        assert ids == expected, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ByteTokenizer(dictionary).encode(text)


def test_only_byte_dictionaries_export_as_a_tokenizer(tmp_path):
    (tmp_path / "dict.txt").write_text("the 3\nof 2\n")
    with pytest.raises(UsageError, match="byte"):
        write_hf_tokenizer(Dictionary.load(tmp_path / "dict.txt"), tmp_path / "hf", "causal_lm")


# ------------------------------------------------------------------------- blocks


def reference_blocks(sizes: list[int], block_size: int, mode: str) -> list[tuple[int, int]]:
    """Brute force over a token list, one sentence at a time."""
    total = sum(sizes)
    if mode == "none":
        return [(start, min(block_size, total - start)) for start in range(0, total, block_size)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if mode == "eos":
        return [(starts[i], min(sizes[i], block_size)) for i in range(len(sizes)) if sizes[i] > 0]
    blocks, current_start, current = [], 0, 0
    for i, size in enumerate(sizes):
        if current > 0 and current + size > block_size:
            blocks.append((current_start, current))
            current_start, current = starts[i], 0
        if current == 0:
            current_start = starts[i]
        current += size
    if current > 0:
        blocks.append((current_start, current))
    return [(start, min(length, block_size)) for start, length in blocks if length > 0]


class ListDataset:
    def __init__(self, sentences: list[np.ndarray]):
        self.sentences = sentences
        self.sizes = np.array([len(s) for s in sentences])

    def get_slice(self, index: int, offset: int, length: int) -> np.ndarray:
        return self.sentences[index][offset : offset + length]


@pytest.mark.parametrize("mode", ["none", "complete", "eos"])
@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_block_boundaries_match_brute_force(mode, block_size):
    rng = np.random.default_rng(block_size)
    sizes = rng.integers(0, 20, size=300)
    sizes[::17] = 0  # empty sentences
    sizes[5::23] = 70  # longer than any block
    starts, lengths = compute_block_boundaries(sizes, block_size, mode)
    assert list(zip(starts.tolist(), lengths.tolist())) == reference_blocks(sizes.tolist(), block_size, mode)


@pytest.mark.parametrize("mode", ["none", "complete", "eos"])
def test_block_contents_come_from_the_token_stream(mode):
    rng = np.random.default_rng(0)
    sentences = [rng.integers(4, 100, size=n) for n in rng.integers(0, 15, size=200)]
    stream = np.concatenate(sentences)
    blocks = TokenBlockDataset(ListDataset(sentences), 10, mode)
    for i in range(len(blocks)):
        start, length = int(blocks.starts[i]), int(blocks.sizes[i])
        assert blocks[i].tolist() == stream[start : start + length].tolist()
        assert 1 <= len(blocks[i]) <= 10


def test_blocks_of_a_large_corpus_keep_their_invariants():
    """200,000 sentences through each mode's array code: blocks in order, none longer than
    the block size; ``none`` tiles the stream, ``complete`` starts at sentence starts and
    drops nothing but the truncated tails, ``eos`` is one block per sentence."""
    sizes = np.random.default_rng(0).integers(1, 600, size=200_000)
    sentence_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    total = int(sizes.sum())
    for mode in ("none", "complete", "eos"):
        starts, lengths = compute_block_boundaries(sizes, 511, mode)
        assert (lengths >= 1).all() and (lengths <= 511).all(), mode
        assert (starts[1:] >= starts[:-1] + lengths[:-1]).all(), mode  # in order, no overlap
        if mode == "none":
            assert starts.tolist() == list(range(0, total, 511)) and int(lengths.sum()) == total
        elif mode == "complete":
            assert np.isin(starts, sentence_starts).all()
            assert int(lengths.sum()) == int(np.minimum(sizes, 511).sum())
        else:
            assert starts.tolist() == sentence_starts.tolist()
            assert lengths.tolist() == np.minimum(sizes, 511).tolist()


def test_bad_break_mode():
    with pytest.raises(UsageError, match="sample_break_mode"):
        compute_block_boundaries(np.array([3, 4]), 8, "sentence")


# ------------------------------------------------------------------------ masking


def masked_dictionary() -> Dictionary:
    dictionary = byte_dictionary()
    dictionary.add_symbol("<mask>")
    return dictionary


def test_masking_statistics_when_special_tokens_are_never_masked():
    dictionary = masked_dictionary()
    masker = DynamicMasker(dictionary, seed=3, mask_prob=0.15, mask_special_tokens=False)
    rng = np.random.default_rng(0)
    specials = np.array([dictionary.index(symbol) for symbol in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")])
    candidates = chosen = masked = randomized = kept = 0
    for index in range(400):
        tokens = rng.integers(4, 260, size=500)
        special_positions = rng.random(500) < 0.05
        tokens[special_positions] = rng.choice(specials, size=special_positions.sum())
        inputs, targets = masker(tokens, epoch=0, index=index)

        is_target = targets != IGNORE_INDEX
        # Special tokens are never chosen and never changed; nothing else changes either.
        assert not is_target[special_positions].any()
        assert (inputs[~is_target] == tokens[~is_target]).all()
        assert (targets[is_target] == tokens[is_target]).all()
        # Random replacements are never special tokens.
        assert not np.isin(inputs[is_target & (inputs != dictionary.mask())], specials).any()

        candidates += int((~special_positions).sum())
        chosen += int(is_target.sum())
        masked += int((inputs[is_target] == dictionary.mask()).sum())
        randomized += int(((inputs != tokens) & (inputs != dictionary.mask())).sum())
        kept += int(((inputs == tokens) & is_target).sum())

    # Tolerances are 5 binomial standard deviations, sqrt(p (1 - p) / n). A random
    # replacement equals the original with chance 1/256 and then looks "kept".
    def within(observed, p, n):
        return abs(observed / n - p) < 5 * np.sqrt(p * (1 - p) / n)

    assert within(chosen, 0.15, candidates)
    assert within(masked, 0.8, chosen)
    assert within(randomized, 0.1 * (1 - 1 / 256), chosen)
    assert within(kept, 0.1 + 0.1 / 256, chosen)


# A block as fairseq's masked_lm builds it: <s>, then documents that each end in </s>
# (one of them holding an <unk>). 129 positions: 0.15 x 129 = 19.35 targets on average.
FIXED_BLOCK = np.concatenate([[0], np.arange(4, 60), [2], np.arange(100, 160), [2], np.arange(200, 208), [3], [2]])
DRAWS = 6000


def masking_draws(masker: DynamicMasker, tokens: np.ndarray = FIXED_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of ``DRAWS`` samples holding the same block (one row per sample index)."""
    pairs = [masker(tokens, epoch=0, index=index) for index in range(DRAWS)]
    return np.stack([inputs for inputs, _ in pairs]), np.stack([targets for _, targets in pairs])


def within(observed: float, p: float, n: int) -> bool:
    """Whether a frequency over n independent trials of probability p lies within 5 binomial
    standard deviations sqrt(p (1 - p) / n) of p. A correct rule fails one such check with
    probability below 6e-7; the wrong rules the checks below tell apart (plain rounding,
    never choosing <s>/</s>, <mask> outside the replacement pool) miss by 20 deviations or
    more at these numbers of draws."""
    return abs(observed - p) <= 5 * np.sqrt(p * (1 - p) / n)


def test_fairseq_masking_chooses_every_position_with_probabilistic_rounding():
    dictionary = masked_dictionary()
    inputs, targets = masking_draws(DynamicMasker(dictionary, seed=3))
    predicted = targets != IGNORE_INDEX
    original = np.broadcast_to(FIXED_BLOCK, inputs.shape)

    # int(0.15 x 129 + u) with u uniform: 19 or 20 targets, 20 with probability 0.35.
    counts = predicted.sum(axis=1)
    assert set(counts.tolist()) <= {19, 20}
    assert within((counts == 20).mean(), 0.15 * len(FIXED_BLOCK) % 1, DRAWS)
    # Every position is chosen at the same rate, <s>, </s> and <unk> included.
    for position, rate in enumerate(predicted.mean(axis=0)):
        assert within(rate, 0.15, DRAWS), (position, FIXED_BLOCK[position], rate)
    # Targets are the original tokens; nothing else changes.
    assert (targets[predicted] == original[predicted]).all()
    assert (inputs[~predicted] == original[~predicted]).all()


def test_fairseq_masking_masks_a_pad_inside_the_data_but_never_predicts_it():
    dictionary = masked_dictionary()
    block = FIXED_BLOCK.copy()
    block[70] = dictionary.pad()
    inputs, targets = masking_draws(DynamicMasker(dictionary, seed=4), block)
    assert (targets[:, 70] == IGNORE_INDEX).all()  # fairseq's criterion ignores pad targets
    assert within((inputs[:, 70] == dictionary.mask()).mean(), 0.15 * (0.8 + 0.1 / 257), DRAWS)


def test_fairseq_masking_splits_80_10_10_and_draws_from_all_but_four_specials():
    dictionary = masked_dictionary()
    pool_size = len(dictionary) - 4  # fairseq zeroes the weights of the first nspecial = 4; <mask> stays in
    inputs, targets = masking_draws(DynamicMasker(dictionary, seed=5))
    original = np.broadcast_to(FIXED_BLOCK, inputs.shape)
    predicted = targets != IGNORE_INDEX
    ordinary = predicted & (original >= 4)  # a random draw can give such a token back...
    special = predicted & (original < 4)  # ...but never one of these
    for chosen, in_pool in ((ordinary, 1), (special, 0)):
        n = int(chosen.sum())
        picked = inputs[chosen]
        kept = picked == original[chosen]
        assert within((picked == dictionary.mask()).mean(), 0.8 + 0.1 / pool_size, n)
        assert within(kept.mean(), 0.1 + 0.1 * in_pool / pool_size, n)
        assert within(((picked != dictionary.mask()) & ~kept).mean(), 0.1 * (1 - (1 + in_pool) / pool_size), n)

    # Random replacements only: every token but <s>, <pad>, </s>, <unk> is drawn, <mask> included.
    inputs, targets = masking_draws(DynamicMasker(dictionary, seed=6, random_token_prob=1.0, leave_unmasked_prob=0.0))
    drawn = inputs[targets != IGNORE_INDEX]
    assert set(drawn.tolist()) == set(range(4, len(dictionary)))
    assert within((drawn == dictionary.mask()).mean(), 1 / pool_size, len(drawn))


def test_masking_option_never_chooses_special_tokens():
    dictionary = masked_dictionary()
    inputs, targets = masking_draws(DynamicMasker(dictionary, seed=3, mask_special_tokens=False))
    special = np.isin(FIXED_BLOCK, dictionary.special_indices())
    assert (targets[:, special] == IGNORE_INDEX).all() and (inputs[:, special] == FIXED_BLOCK[special]).all()
    # Rounding as fairseq's, over the 124 ordinary positions: 18.6 -> 18 or 19.
    counts = (targets != IGNORE_INDEX).sum(axis=1)
    assert set(counts.tolist()) <= {18, 19}
    assert within((counts == 19).mean(), 0.15 * (~special).sum() % 1, DRAWS)
    changed = inputs[(inputs != FIXED_BLOCK) & (inputs != dictionary.mask())]
    assert len(changed) > 0 and not np.isin(changed, dictionary.special_indices()).any()


def test_masking_depends_only_on_seed_epoch_and_index():
    dictionary = masked_dictionary()
    tokens = np.random.default_rng(1).integers(4, 260, size=200)
    masker = DynamicMasker(dictionary, seed=7)
    first = masker(tokens, 0, 5)
    assert all((a == b).all() for a, b in zip(first, DynamicMasker(dictionary, seed=7)(tokens, 0, 5)))
    assert not (first[1] == masker(tokens, 1, 5)[1]).all()  # a new epoch masks afresh
    assert not (first[1] == DynamicMasker(dictionary, seed=8)(tokens, 0, 5)[1]).all()


# ------------------------------------------------------------------------ sampler


def global_stream(
    sampler_args: dict, dp_size: int, micro: int, update_freq: int, consumed: int, steps: int
) -> list[list[tuple[int, int]]]:
    """Per update, the concatenation of every rank's micro-batches in rank order."""
    samplers = [
        GlobalBatchSampler(micro_batch_size=micro, update_freq=update_freq, dp_rank=r, dp_size=dp_size, **sampler_args)
        for r in range(dp_size)
    ]
    updates = []
    for _ in range(steps):
        micro_batches = [micro_batch for sampler in samplers for micro_batch in sampler.local_micro_batches(consumed)]
        updates.append([pair for micro_batch in micro_batches for pair in micro_batch])
        consumed += samplers[0].global_batch_size
    return updates


def test_sampler_is_independent_of_world_size_and_micro_batching():
    args = {"num_samples": 23, "seed": 5}
    # 8 samples per update over 23 samples: updates straddle epoch boundaries.
    one_rank = global_stream(args, dp_size=1, micro=8, update_freq=1, consumed=0, steps=9)
    assert global_stream(args, dp_size=2, micro=4, update_freq=1, consumed=0, steps=9) == one_rank
    assert global_stream(args, dp_size=2, micro=2, update_freq=2, consumed=0, steps=9) == one_rank
    assert global_stream(args, dp_size=1, micro=4, update_freq=2, consumed=0, steps=9) == one_rank
    assert global_stream(args, dp_size=4, micro=1, update_freq=2, consumed=0, steps=9) == one_rank
    # Resuming from a consumed count continues exactly where the run was.
    assert global_stream(args, dp_size=2, micro=4, update_freq=1, consumed=40, steps=4) == one_rank[5:]

    stream = [pair for update in one_rank for pair in update]
    for epoch in range(3):
        in_epoch = [index for e, index in stream if e == epoch]
        assert sorted(in_epoch) == list(range(23))  # each epoch visits every sample once
        assert in_epoch != list(range(23))  # and shuffles
    assert [e for e, _ in stream] == sorted(e for e, _ in stream)
    epochs_seen = {e for e, _ in one_rank[2]}
    assert epochs_seen == {0, 1}  # positions 16..23 cross the first epoch boundary


def test_sampler_micro_batch_shape_and_rank_slices():
    settings = {"num_samples": 100, "micro_batch_size": 3, "update_freq": 2, "dp_size": 2, "seed": 0, "shuffle": False}
    sampler = GlobalBatchSampler(dp_rank=1, **settings)
    assert sampler.global_batch_size == 12
    assert sampler.local_micro_batches(0) == [[(0, 6), (0, 7), (0, 8)], [(0, 9), (0, 10), (0, 11)]]
    # At 96 the global batch is positions 96..107: rank 0 straddles the epoch boundary.
    assert sampler.local_micro_batches(96) == [[(1, 2), (1, 3), (1, 4)], [(1, 5), (1, 6), (1, 7)]]
    rank0 = GlobalBatchSampler(dp_rank=0, **settings)
    assert rank0.local_micro_batches(96) == [[(0, 96), (0, 97), (0, 98)], [(0, 99), (1, 0), (1, 1)]]
    assert sampler.epoch_of(99) == 0 and sampler.epoch_of(100) == 1


def test_sampler_rejects_bad_settings():
    with pytest.raises(UsageError, match="dp_rank"):
        GlobalBatchSampler(10, 2, 1, dp_rank=2, dp_size=2, seed=0)
    with pytest.raises(UsageError, match="micro_batch_size"):
        GlobalBatchSampler(10, 0, 1, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(UsageError, match="samples"):
        GlobalBatchSampler(0, 2, 1, dp_rank=0, dp_size=1, seed=0)


# ------------------------------------------------------------- load_lm_data, collate


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A small fairseq-preprocess style directory of byte-level sentences."""
    rng = np.random.default_rng(0)
    byte_dictionary().save(tmp_path / "dict.txt")
    for split, count in (("train", 300), ("valid", 20)):
        sentences = [np.append(rng.integers(4, 260, size=n), 2) for n in rng.integers(1, 60, size=count)]
        write_indexed_dataset(tmp_path / split, sentences, np.uint16)
    return tmp_path


def token_stream(directory: Path, split: str) -> np.ndarray:
    dataset = MMapIndexedDataset(directory / split)
    return np.concatenate([dataset[i] for i in range(len(dataset))])


def test_masked_lm_collate(data_dir):
    data = load_lm_data(data_dir, "train", "masked_lm", tokens_per_sample=32, seed=3)
    assert len(data.dictionary) == 261 and data.dictionary.mask() == 260
    pairs = [(0, 0), (0, 5), (1, 9)]
    batch = data.collate(pairs)
    assert batch["input_ids"].dtype == batch["targets"].dtype == torch.long
    lengths = [int(data.blocks.sizes[index]) + 1 for _, index in pairs]
    assert batch["input_ids"].shape == batch["targets"].shape == (3, max(lengths))
    assert max(lengths) <= 32
    assert (batch["input_ids"][:, 0] == data.dictionary.bos()).all()
    for row, length in enumerate(lengths):
        assert (batch["input_ids"][row, length:] == data.dictionary.pad()).all()
        assert (batch["targets"][row, length:] == IGNORE_INDEX).all()
    assert batch["ntokens"].dim() == 0
    assert int(batch["ntokens"]) == int((batch["targets"] != IGNORE_INDEX).sum()) > 0
    # Unmasked positions hold the block's tokens exactly.
    stream = token_stream(data_dir, "train")
    start, size = int(data.blocks.starts[5]), int(data.blocks.sizes[5])
    original = np.concatenate([[0], stream[start : start + size]])
    row = batch["input_ids"][1, : size + 1].numpy()
    targets = batch["targets"][1, : size + 1].numpy()
    assert (row[targets == IGNORE_INDEX] == original[targets == IGNORE_INDEX]).all()
    assert (targets[targets != IGNORE_INDEX] == original[targets != IGNORE_INDEX]).all()


@pytest.mark.parametrize("mode", ["none", "complete", "eos"])
def test_causal_lm_collate(data_dir, mode):
    data = load_lm_data(data_dir, "train", "causal_lm", tokens_per_sample=16, sample_break_mode=mode)
    stream = token_stream(data_dir, "train")
    pairs = [(0, i) for i in range(0, len(data), max(1, len(data) // 6))]
    batch = data.collate(pairs)
    assert batch["input_ids"].shape[1] <= 16
    for row, (_, index) in enumerate(pairs):
        start, size = int(data.blocks.starts[index]), int(data.blocks.sizes[index])
        assert 2 <= size <= 17
        block = stream[start : start + size]
        assert batch["input_ids"][row, : size - 1].tolist() == block[:-1].tolist()
        assert batch["targets"][row, : size - 1].tolist() == block[1:].tolist()
        assert (batch["targets"][row, size - 1 :] == IGNORE_INDEX).all()
        assert (batch["input_ids"][row, size - 1 :] == data.dictionary.pad()).all()
    assert int(batch["ntokens"]) == sum(int(data.blocks.sizes[i]) - 1 for _, i in pairs)


def test_masks_do_not_depend_on_batch_or_world_size(data_dir):
    data = load_lm_data(data_dir, "train", "masked_lm", tokens_per_sample=24, seed=11)
    alone = {}
    for dp_size in (1, 2, 4):
        for rank in range(dp_size):
            sampler = GlobalBatchSampler(len(data), 8 // dp_size, update_freq=1, dp_rank=rank, dp_size=dp_size, seed=2)
            for consumed in (0, len(data) - 4):  # the second batch straddles two epochs
                for micro_batch in sampler.local_micro_batches(consumed):
                    batch = data.collate(micro_batch)
                    for row, pair in enumerate(micro_batch):
                        if pair not in alone:
                            single = data.collate([pair])
                            alone[pair] = (single["input_ids"][0], single["targets"][0])
                        width = len(alone[pair][0])
                        assert torch.equal(batch["input_ids"][row, :width], alone[pair][0])
                        assert torch.equal(batch["targets"][row, :width], alone[pair][1])
    assert len({epoch for epoch, _ in alone}) == 2


def test_validation_masks_do_not_change_with_the_epoch(data_dir):
    def masks(split, epoch, **options):
        data = load_lm_data(data_dir, split, "masked_lm", tokens_per_sample=24, seed=11, **options)
        batch = data.collate([(epoch, index) for index in range(8)])
        return torch.cat([batch["input_ids"], batch["targets"]])

    assert torch.equal(masks("valid", 0), masks("valid", 1))
    assert torch.equal(masks("valid", 0), masks("valid", 7))
    assert not torch.equal(masks("train", 0), masks("train", 1))
    # The default follows the split; fixed_masks says it explicitly.
    assert torch.equal(masks("train", 0, fixed_masks=True), masks("train", 5, fixed_masks=True))
    assert not torch.equal(masks("valid", 0, fixed_masks=False), masks("valid", 1, fixed_masks=False))


def test_load_lm_data_masks_special_tokens_unless_told_not_to(data_dir):
    pairs = [(0, index) for index in range(40)]
    default = load_lm_data(data_dir, "train", "masked_lm", tokens_per_sample=24, seed=2).collate(pairs)
    assert (default["targets"][:, 0] == 0).any()  # <s> is a target in some of the 40 samples
    option = load_lm_data(data_dir, "train", "masked_lm", tokens_per_sample=24, seed=2, mask_special_tokens=False)
    targets = option.collate(pairs)["targets"]
    assert not np.isin(targets.numpy(), option.dictionary.special_indices()).any()


def test_resumed_dictionary_must_match(data_dir):
    data = load_lm_data(data_dir, "train", "masked_lm", tokens_per_sample=16)
    restored = Dictionary.from_symbols(list(data.dictionary.symbols))
    assert load_lm_data(data_dir, "train", "masked_lm", 16, dictionary=restored).dictionary is restored
    with pytest.raises(UsageError, match="symbols"):
        load_lm_data(data_dir, "train", "causal_lm", 16, dictionary=restored)  # no <mask> for causal_lm
    swapped = list(restored.symbols)
    swapped[10], swapped[11] = swapped[11], swapped[10]
    with pytest.raises(UsageError, match="index 10"):
        load_lm_data(data_dir, "train", "masked_lm", 16, dictionary=Dictionary.from_symbols(swapped))


def test_load_lm_data_usage_errors(data_dir, tmp_path):
    with pytest.raises(UsageError, match="task"):
        load_lm_data(data_dir, "train", "seq2seq", 16)
    with pytest.raises(UsageError, match="not a directory"):
        load_lm_data(tmp_path / "nowhere", "train", "masked_lm", 16)
    with pytest.raises(UsageError, match="test.idx"):
        load_lm_data(data_dir, "test", "masked_lm", 16)
    with pytest.raises(UsageError, match="tokens_per_sample"):
        load_lm_data(data_dir, "train", "masked_lm", 1)
    (data_dir / "dict.txt").unlink()
    with pytest.raises(UsageError, match="dict.txt"):
        load_lm_data(data_dir, "train", "masked_lm", 16)


def test_token_ids_beyond_the_dictionary_are_reported(data_dir):
    """At load, wherever in the file they are: a sample that meets one later would stop only
    the rank or data worker that reads it."""
    (data_dir / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(50)))
    with pytest.raises(UsageError, match="outside the dictionary"):
        load_lm_data(data_dir, "train", "causal_lm", 16)
