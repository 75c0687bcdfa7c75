"""``python -m distlm.prepare`` / ``distlm.data.prepare`` and training on its output with a
Hugging Face tokenizer, given or trained on the raw text.

A small byte-level BPE tokenizer is trained here with the ``tokenizers`` library on the
standard library's prose (the built-in corpus's source), so the reference encodings and
decodings come from that library, not from distlm. The tokenizers distlm trains itself are
checked through what they must do: decode every document back to its text, and give
transformers, after an export, the ids and the logits distlm's model had.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from distlm.data import MMapIndexedDataset, load_lm_data  # noqa: E402
from distlm.data import corpus  # noqa: E402
from distlm.data.hf_tokenizer import HFVocabulary, copy_tokenizer_files, save_tokenizer  # noqa: E402
from distlm.data import prepare as prepare_module  # noqa: E402
from distlm.data.prepare import choose_valid_documents, main, prepare  # noqa: E402
from distlm.errors import UsageError  # noqa: E402
from distlm.prepare import main as prepare_main  # noqa: E402

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
VALID_FRACTION = 0.05


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """About 200 KB of distinct prose paragraphs of the standard library, plus awkward ones."""
    paragraphs, size = [], 0
    for _, paragraph in corpus.iter_stdlib_paragraphs():
        if corpus.looks_like_prose(paragraph) and paragraph not in paragraphs:
            paragraphs.append(paragraph)
            size += len(paragraph)
            if size > 200_000:
                break
    # A special token typed in a document is text; so are non-ASCII characters.
    return paragraphs + ["Ends with </s> and <mask> inside, as text.", "naïve café — 東京 🐍\n  indented line"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, documents) -> Path:
    """A 500-token byte-level BPE tokenizer saved as Hugging Face files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    roles = ("bos_token", "pad_token", "eos_token", "unk_token", "mask_token")
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(zip(roles, SPECIALS))))
    return directory


@pytest.fixture(scope="module")
def reference(tokenizer_dir):
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.encode_special_tokens = True  # a special token's spelling in a document is text
    return tokenizer


@pytest.fixture(scope="module")
def text_input(tmp_path_factory, documents) -> Path:
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    # Blank lines between documents, some of them holding spaces, and extra ones at the ends.
    separators = itertools.cycle(["\n\n", "\n  \n", "\n\n\n"])
    path.write_text("\n" + "".join(doc + next(separators) for doc in documents), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_dir, text_input) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("prepared")
    stats = prepare(tokenizer_dir, [text_input], out, valid_fraction=VALID_FRACTION, seed=3, progress=False)
    return out, stats


def read_split(directory: Path, split: str) -> list[np.ndarray]:
    dataset = MMapIndexedDataset(directory / split)
    assert dataset.flavour == "megatron"
    return [dataset[i] for i in range(len(dataset))]


def test_prepared_documents_decode_to_the_input(prepared, documents, reference):
    out, stats = prepared
    eos = reference.token_to_id("</s>")
    train, valid = read_split(out, "train"), read_split(out, "valid")
    assert len(valid) == round(VALID_FRACTION * len(documents))
    assert len(train) + len(valid) == len(documents)
    assert stats["train"] == {"documents": len(train), "tokens": sum(map(len, train))}

    expected = {doc: reference.encode(doc, add_special_tokens=False).ids + [eos] for doc in documents}
    decoded = []
    for sequence in train + valid:
        text = reference.decode(sequence.tolist(), skip_special_tokens=True)
        decoded.append(text)
        # One eos at the end; a "</s>" typed in a document stays text.
        assert sequence.tolist() == expected[text]
    assert sorted(decoded) == sorted(documents)
    # Training documents keep the input order.
    train_texts = decoded[: len(train)]
    assert train_texts == [doc for doc in documents if doc in set(train_texts)]
    assert MMapIndexedDataset(out / "train").dtype == np.uint16  # 500 ids do not fit a byte


def test_jsonl_input_gives_the_same_data_and_the_seed_decides_the_split(
    prepared, tmp_path, tokenizer_dir, documents
):
    out, _ = prepared
    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "text": doc}) + "\n" for i, doc in enumerate(documents)) + "\n")
    prepare(tokenizer_dir, [lines], tmp_path / "jsonl", valid_fraction=VALID_FRACTION, seed=3, progress=False)
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert (tmp_path / "jsonl" / name).read_bytes() == (out / name).read_bytes()

    # --text-key reads any file name as JSON lines, under that key.
    renamed = tmp_path / "docs.data"
    renamed.write_text("".join(json.dumps({"body": doc}) + "\n" for doc in documents))
    prepare(tokenizer_dir, [renamed], tmp_path / "key", text_key="body", valid_fraction=VALID_FRACTION, seed=4,
            progress=False)
    assert (tmp_path / "key" / "train.bin").read_bytes() != (out / "train.bin").read_bytes()
    together = sorted(s.tobytes() for split in ("train", "valid") for s in read_split(tmp_path / "key", split))
    assert together == sorted(s.tobytes() for split in ("train", "valid") for s in read_split(out, split))


def test_jsonl_and_parquet_files_on_two_workers_give_the_plain_texts_data(
    prepared, tmp_path, tokenizer_dir, documents, capsys
):
    """Several files read by a pool of 2 processes, each encoding its own part: the parts
    joined in input order are byte for byte the data of one plain-text file, one process."""
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    out, _ = prepared
    thirds = np.array_split(np.arange(len(documents)), 3)
    jsonl_inputs = []
    for number, third in enumerate(thirds):
        path = tmp_path / f"part{number}.jsonl"
        path.write_text("".join(json.dumps({"text": documents[i], "id": int(i)}) + "\n" for i in third))
        jsonl_inputs.append(path)
    parquet_inputs = []
    for number, third in enumerate(thirds):
        path = tmp_path / f"part{number}.parquet"
        # An empty text is skipped as a blank paragraph is; small row groups make the record
        # batches cross them.
        texts = [documents[i] for i in third] + ([""] if number == 1 else [])
        table = pyarrow.table({"id": list(range(len(texts))), "body": texts})
        pyarrow.parquet.write_table(table, path, row_group_size=37)
        parquet_inputs.append(path)

    assert main(["--tokenizer", str(tokenizer_dir), "--input", *map(str, jsonl_inputs), "--out",
                 str(tmp_path / "jsonl"), "--valid-fraction", str(VALID_FRACTION), "--seed", "3", "--workers", "2"]) == 0
    # The progress bar counts the documents the workers encoded, all of them by the end.
    assert f"{len(documents)}/{len(documents)}" in capsys.readouterr().err
    prepare(tokenizer_dir, parquet_inputs, tmp_path / "parquet", text_key="body", valid_fraction=VALID_FRACTION,
            seed=3, progress=False, workers=2)
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert (tmp_path / "jsonl" / name).read_bytes() == (out / name).read_bytes(), name
        assert (tmp_path / "parquet" / name).read_bytes() == (out / name).read_bytes(), name
    assert not list((tmp_path / "parquet").glob(".*partial*"))


def exit_at_once(task):
    os._exit(9)


def test_a_worker_that_dies_is_one_line_and_leaves_no_parts(tmp_path, tokenizer_dir, text_input, monkeypatch, capsys):
    # The workers are forked, so they run the patched function: a worker killed while it encodes.
    monkeypatch.setattr(prepare_module, "_encode_part", exit_at_once)
    assert main(["--tokenizer", str(tokenizer_dir), "--input", str(text_input), str(text_input), "--out",
                 str(tmp_path / "out"), "--workers", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("distlm.data.prepare: error: a --workers process died while it encoded"), lines
    assert not any(line.startswith("distlm") for line in lines[:-1])  # the rest is the progress bar
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == []


def test_command_line_prints_rates(tmp_path, tokenizer_dir, documents, capsys):
    source = tmp_path / "few.txt"
    source.write_text("\n\n".join(documents[:50]))
    assert main(["--tokenizer", str(tokenizer_dir), "--input", str(source), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "train: 49 documents" in out and "valid: 1 documents" in out
    assert "documents/s" in out and "tokens/s" in out
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).is_file()
    assert not list((tmp_path / "out").glob(".*partial*"))
    # Without a validation split, an earlier run's does not stay behind.
    assert main(["--tokenizer", str(tokenizer_dir), "--input", str(source), "--out", str(tmp_path / "out"),
                 "--valid-fraction", "0"]) == 0
    assert "train: 50 documents" in capsys.readouterr().out
    assert not (tmp_path / "out" / "valid.idx").exists() and not (tmp_path / "out" / "valid.bin").exists()


def test_prepared_files_copy_the_tokenizer(prepared, tokenizer_dir):
    out, _ = prepared
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tokenizer_dir / name).read_bytes()


# ----------------------------------------------------------------- load_lm_data


def test_samples_use_the_tokenizers_special_ids(prepared, reference, tmp_path):
    out, _ = prepared
    ids = {token: reference.token_to_id(token) for token in SPECIALS}
    data = load_lm_data(out, "train", "masked_lm", tokens_per_sample=64)
    vocabulary = data.dictionary
    assert isinstance(vocabulary, HFVocabulary) and data.tokenizer_dir == out
    assert len(vocabulary) == reference.get_vocab_size() == 500
    assert (vocabulary.bos(), vocabulary.pad(), vocabulary.eos(), vocabulary.unk(), vocabulary.mask()) == (
        ids["<s>"], ids["<pad>"], ids["</s>"], ids["<unk>"], ids["<mask>"]
    )
    assert sorted(vocabulary.special_indices()) == sorted(ids.values())
    assert vocabulary.symbols == [reference.id_to_token(i) for i in range(500)]
    batch = data.collate([(0, 0), (0, 1), (0, 2)])
    assert (batch["input_ids"][:, 0] == ids["<s>"]).all()
    assert (batch["input_ids"] == ids["<mask>"]).any()
    originals = np.where(batch["targets"] != -100, batch["targets"], batch["input_ids"])
    assert (originals == ids["</s>"]).any()

    causal = load_lm_data(out, "valid", "causal_lm", tokens_per_sample=32)
    sample_inputs, sample_targets = causal.sample(0, 0)
    block = causal.blocks[0]
    assert sample_inputs.tolist() == block[:-1].tolist() and sample_targets.tolist() == block[1:].tolist()
    assert causal.dictionary.pad() == ids["<pad>"]

    # A checkpoint's symbol list is checked against the tokenizer.
    assert load_lm_data(out, "train", "masked_lm", 64, symbols=vocabulary.symbols).dictionary == vocabulary
    changed = list(vocabulary.symbols)
    changed[300] = "something else"
    with pytest.raises(UsageError, match="index 300"):
        load_lm_data(out, "train", "masked_lm", 64, symbols=changed)

    copied = save_tokenizer(vocabulary, tmp_path / "export", "masked_lm")
    assert sorted(path.name for path in copied) == ["tokenizer.json", "tokenizer_config.json"]


def small_tokenizer_dir(root: Path, vocab: dict[str, int], specials: list[str], config: dict | None) -> Path:
    """A word-level tokenizer with exactly the given special tokens, and its config file if any."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>" if "<unk>" in vocab else None))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    root.mkdir()
    tokenizer.save(str(root / "tokenizer.json"))
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_llama_style_tokenizer_pads_causal_lm_with_eos_and_refuses_masked_lm(tmp_path):
    # Llama's layout: <unk>=0, <s>=1, </s>=2, no pad, no mask.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "cat": 4, "sat": 5}
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    directory = small_tokenizer_dir(tmp_path / "llama", vocab, ["<unk>", "<s>", "</s>"], config)
    (tmp_path / "docs.txt").write_text("the cat sat\n\nthe cat\n\nsat the cat sat\n\ncat")
    # The data may go into the tokenizer's own directory.
    stats = prepare(directory, [tmp_path / "docs.txt"], directory, valid_fraction=0.25, progress=False)
    assert stats["valid"]["documents"] == 1
    data = load_lm_data(directory, "train", "causal_lm", tokens_per_sample=8)
    assert data.dictionary.pad() == data.dictionary.eos() == 2
    assert MMapIndexedDataset(directory / "train").dtype == np.uint8  # 6 ids fit a byte
    with pytest.raises(UsageError, match=f"tokenizer {directory} has no mask token"):
        load_lm_data(directory, "train", "masked_lm", tokens_per_sample=8)


def test_tokenizer_roles_come_from_config_files(tmp_path):
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3, "[MASK]": 4, "word": 5}
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    config = {
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "mask_token": {"content": "[MASK]", "special": True},  # transformers' AddedToken form
        "unk_token": "[UNK]",
    }
    bert = small_tokenizer_dir(tmp_path / "bert", vocab, specials, config)
    vocabulary = HFVocabulary.load(bert, "masked_lm")
    roles = (vocabulary.bos(), vocabulary.eos(), vocabulary.pad(), vocabulary.mask(), vocabulary.unk())
    assert roles == (1, 2, 3, 4, 0)
    # special_tokens_map.json wins over tokenizer_config.json, as in transformers.
    (bert / "special_tokens_map.json").write_text(json.dumps({"pad_token": "[UNK]"}))
    assert HFVocabulary.load(bert, "masked_lm").pad() == 0
    (bert / "special_tokens_map.json").write_text(json.dumps({"pad_token": "[SEP]"}))
    with pytest.raises(UsageError, match="pad token of its own"):
        HFVocabulary.load(bert, "masked_lm")  # RoBERTa would hide every [SEP] as padding
    (bert / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>"}))
    with pytest.raises(UsageError, match="pad_token '<pad>'"):
        HFVocabulary.load(bert, "masked_lm")

    # A tokenizer saved alone: the conventional spellings, when they are special tokens.
    bare = small_tokenizer_dir(tmp_path / "bare", {"<unk>": 0, "</s>": 1, "<pad>": 2, "x": 3}, ["</s>", "<pad>"], None)
    vocabulary = HFVocabulary.load(bare, "causal_lm")
    assert (vocabulary.eos(), vocabulary.pad()) == (1, 2)
    with pytest.raises(UsageError, match="no unk token"):
        vocabulary.unk()  # "<unk>" is in the vocabulary but not a special token
    no_eos = small_tokenizer_dir(tmp_path / "no_eos", {"<unk>": 0, "x": 1}, ["<unk>"], {"unk_token": "<unk>"})
    with pytest.raises(UsageError, match="no eos token .*causal_lm"):
        HFVocabulary.load(no_eos, "causal_lm")


# ----------------------------------------------------------------------- training


def test_training_on_prepared_data_lowers_the_loss(prepared, capsys):
    from distlm import TrainConfig, Trainer

    out, _ = prepared
    config = TrainConfig()
    config.data.data = str(out)
    config.model.arch = "llama_tiny"
    config.data.batch_size = 8
    config.data.tokens_per_sample = 64
    config.optim.max_update = 20
    config.optim.warmup_updates = 5
    config.optim.lr = 1e-3
    config.checkpoint.no_save = True
    config.logging.log_interval = 5
    config.logging.log_format = "json"
    trainer = Trainer(config)
    assert isinstance(trainer.data.dictionary, HFVocabulary) and len(trainer.data.dictionary) == 500
    trainer.fit()
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    losses = [record["loss"] for record in records if record["kind"] == "train"]
    assert len(losses) == 5  # updates 1, 5, 10, 15, 20
    assert losses[-1] < losses[0] - 0.5, losses


ARCH_TASKS = {"llama_tiny": "causal_lm", "roberta_tiny": "masked_lm"}


def train_two_updates_and_export(data: Path | None, arch: str, root: Path) -> tuple[Path, Path]:
    """2 updates of ``arch`` on ``data`` (None: the built-in corpus), saved, then
    ``python -m distlm.export --hf``; returns the save dir and the export."""
    from distlm.config import parse_args
    from distlm.export.cli import main as export_main
    from distlm.training.trainer import Trainer

    save_dir, hf_dir = root / "run", root / "hf"
    Trainer(parse_args([
        *([] if data is None else ["--data", str(data)]), "--arch", arch, "--tokens-per-sample", "32",
        "--batch-size", "2", "--max-update", "2", "--disable-validation", "--save-dir", str(save_dir),
        "--device", "cpu", "--log-interval", "1000",
    ])).fit()
    assert export_main(["--checkpoint", str(save_dir), "--hf", str(hf_dir)]) == 0
    return save_dir, hf_dir


@pytest.mark.parametrize("arch", ["llama_tiny", "roberta_tiny"])
def test_exported_tokenizer_encodes_text_as_the_data_pipeline_did(arch, prepared, reference, tokenizer_dir, tmp_path):
    """prepare -> 2 updates -> ``python -m distlm.export --hf``: the export carries the
    tokenizer, and transformers' AutoTokenizer of it encodes a document's text to the ids
    the pipeline wrote for it (less the end-of-document token it appends, which is not
    part of the text) and to exactly the ids the model saw for it: for a causal LM the
    text alone (neither side adds a bos), for a masked LM ``<s>`` text ``</s>``."""
    transformers = pytest.importorskip("transformers")
    out, _ = prepared
    _, hf_dir = train_two_updates_and_export(out, arch, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf_dir / name).read_bytes() == (tokenizer_dir / name).read_bytes()
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)

    task = ARCH_TASKS[arch]
    # One document per sample, so sample i is document i of the split as the model sees it.
    data = load_lm_data(out, "train", task, tokens_per_sample=4096, sample_break_mode="eos")
    eos = reference.token_to_id("</s>")
    checked = 0
    for index, written in enumerate(read_split(out, "train")[:40]):
        written = written.tolist()
        text = reference.decode(written, skip_special_tokens=True)
        if "</s>" in text or "<mask>" in text:
            continue  # the pipeline encodes a special token's spelling as text, transformers as the token
        encoded = auto(text)["input_ids"]
        inputs, targets = data.sample(0, index)
        seen = np.where(targets != -100, targets, inputs) if task == "masked_lm" else inputs  # masks undone
        assert encoded == seen.tolist(), (index, text)
        assert written[-1] == eos
        assert (encoded if task == "causal_lm" else encoded[1:-1]) == written[:-1], (index, text)
        checked += 1
    assert checked >= 30


# ------------------------------------------------- raw text: a tokenizer trained here

RAW_VOCAB = 300  # the 256 bytes, 5 specials and a few merges: a tiny model's embedding


@pytest.fixture(scope="module")
def raw_prepared(tmp_path_factory, text_input) -> Path:
    """``python -m distlm.prepare`` on the raw text, with no tokenizer given."""
    out = tmp_path_factory.mktemp("raw_prepared")
    args = ["--input", str(text_input), "--out", str(out), "--vocab-size", str(RAW_VOCAB),
            "--valid-fraction", str(VALID_FRACTION), "--seed", "3"]
    assert prepare_main(args) == 0
    return out


def decoded_splits(directory: Path) -> dict[str, list[str]]:
    """Every written document of each split, decoded by the directory's own tokenizer file."""
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    texts: dict[str, list[str]] = {}
    for split in [split for split in ("train", "valid") if (directory / f"{split}.idx").exists()]:
        sequences = [sequence.tolist() for sequence in read_split(directory, split)]
        assert all(sequence[-1] == eos and eos not in sequence[:-1] for sequence in sequences)
        texts[split] = [tokenizer.decode(sequence, skip_special_tokens=True) for sequence in sequences]
    return texts


def test_prepare_trains_a_byte_level_tokenizer_beside_the_data(raw_prepared, documents):
    out = raw_prepared
    names = sorted(path.name for path in out.iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "train.bin", "train.idx",
                     "valid.bin", "valid.idx"]
    # Every document, typed "</s>" and non-ASCII ones included, decodes back to its text.
    texts = decoded_splits(out)
    assert sorted(texts["train"] + texts["valid"]) == sorted(documents)
    assert len(texts["valid"]) == round(VALID_FRACTION * len(documents))
    vocabulary = HFVocabulary.load(out, "masked_lm")
    assert len(vocabulary) == RAW_VOCAB and vocabulary.symbols[:5] == SPECIALS
    assert (vocabulary.bos(), vocabulary.pad(), vocabulary.eos(), vocabulary.unk(), vocabulary.mask()) == (0, 1, 2, 3, 4)
    unk = vocabulary.unk()
    assert all(unk not in sequence for split in ("train", "valid") for sequence in read_split(out, split))


def test_the_tokenizer_is_trained_on_the_training_documents_only(tmp_path, documents):
    """A word repeated in one held-out document only becomes a token when that document
    trains the tokenizer (no validation split), never when it is held out."""
    few = documents[:300]
    held_out = int(np.flatnonzero(choose_valid_documents(len(few) + 1, 0.05, seed=5))[0])
    leaky = " ".join(["zqxwv"] * 400)
    source = tmp_path / "docs.txt"
    source.write_text("\n\n".join(few[:held_out] + [leaky] + few[held_out:]))
    vocabularies = {}
    for fraction in (0.05, 0.0):
        out = tmp_path / f"out{fraction}"
        prepare(None, [source], out, valid_fraction=fraction, seed=5, progress=False, vocab_size=400)
        vocabularies[fraction] = HFVocabulary.load(out).symbols
    assert leaky in decoded_splits(tmp_path / "out0.05")["valid"]
    assert "zqxwv" not in {symbol.lstrip("Ġ") for symbol in vocabularies[0.05]}
    assert "zqxwv" in {symbol.lstrip("Ġ") for symbol in vocabularies[0.0]}


def test_a_rerun_replaces_the_tokenizer_it_trained_with_all_its_data(tmp_path, documents, capsys):
    """unigram, then BPE of another size into the same directory: the data is the new
    tokenizer's (it decodes every document), and transformers reads the directory."""
    transformers = pytest.importorskip("transformers")
    texts = documents[:200] + documents[-2:]
    source = tmp_path / "docs.txt"
    source.write_text("\n\n".join(texts))
    out = tmp_path / "out"
    assert prepare_main(["--input", str(source), "--out", str(out), "--tokenizer-model", "unigram",
                         "--vocab-size", "320"]) == 0
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "Unigram"
    decoded = decoded_splits(out)
    assert sorted(decoded["train"] + decoded["valid"]) == sorted(texts)
    assert prepare_main(["--input", str(source), "--out", str(out), "--vocab-size", "280",
                         "--valid-fraction", "0"]) == 0
    assert "tokenizer: bpe, 280 tokens, trained on the training split" in capsys.readouterr().out
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert len(HFVocabulary.load(out)) == 280
    assert decoded_splits(out) == {"train": texts}  # and no validation split left behind
    reference = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    reference.encode_special_tokens = True
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in texts[-2:]:
        ids = auto(text)["input_ids"]  # the data directory's tokenizer adds no special tokens
        assert ids == reference.encode(text).ids and auto.decode(ids) == text


@pytest.mark.parametrize("arch", ["llama_tiny", "roberta_tiny"])
def test_raw_text_to_a_model_that_transformers_runs(arch, raw_prepared, documents, tmp_path):
    """prepare (tokenizer trained) -> 2 updates -> export: transformers' AutoTokenizer of the
    export round-trips the documents and encodes each to exactly the ids the model saw for
    it (``<s>`` text ``</s>`` for a masked LM, text ``</s>`` for a causal LM), and
    AutoModelFor* gives distlm's logits on them."""
    transformers = pytest.importorskip("transformers")
    from distlm.checkpoint import CheckpointReader
    from test_hf_training import _distlm_model

    out, task = raw_prepared, ARCH_TASKS[arch]
    save_dir, hf_dir = train_two_updates_and_export(out, arch, tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)
    # One document per sample, so sample i is document i of the split as the model sees it.
    data = load_lm_data(out, "train", task, tokens_per_sample=4096, sample_break_mode="eos")
    texts = decoded_splits(out)["train"]
    for index, text in enumerate(texts[:400]):
        inputs, targets = data.sample(0, index)
        if task == "masked_lm":
            seen = np.where(targets != -100, targets, inputs).tolist()  # masks undone
        else:
            seen = inputs.tolist() + targets[-1:].tolist()
        ids = auto(text)["input_ids"]
        assert ids == seen, (index, text)
        assert auto.decode(ids, skip_special_tokens=True) == text
    for text in documents[-2:]:  # typed special tokens and non-ASCII text, wherever the split put them
        assert auto.decode(auto(text)["input_ids"], skip_special_tokens=True) == text

    load = transformers.AutoModelForCausalLM if task == "causal_lm" else transformers.AutoModelForMaskedLM
    hf = load.from_pretrained(hf_dir, dtype=torch.float32).eval()
    distlm_model = _distlm_model(CheckpointReader(save_dir))
    with torch.no_grad():
        for text in (texts[0], documents[-1]):
            ids = auto(text, return_tensors="pt")["input_ids"][:, :32]
            torch.testing.assert_close(hf(ids).logits, distlm_model(ids), rtol=0, atol=1e-5)


def test_default_corpus_run_exports_a_tokenizer_transformers_loads(tmp_path, monkeypatch, caplog):
    """The default run (built-in corpus, byte-level) saves its tokenizer with no tokenizers
    package installed and logs nothing about one; transformers loads the export's tokenizer,
    which encodes text to the corpus's ids."""
    transformers = pytest.importorskip("transformers")
    from distlm.data import ByteTokenizer, Dictionary

    # The built-in corpus from the standard library's first paragraphs only: the same
    # build and the same default run as the full corpus, in a fraction of its time.
    monkeypatch.setenv("DISTLM_CACHE_DIR", str(tmp_path / "cache"))
    paragraphs = list(itertools.islice(corpus.iter_stdlib_paragraphs(), 1500))
    monkeypatch.setattr(corpus, "iter_stdlib_paragraphs", lambda: iter(paragraphs))
    monkeypatch.setattr(corpus, "_MIN_TEXT_BYTES", 0)
    with monkeypatch.context() as hidden, caplog.at_level(logging.INFO, logger="distlm"):
        hidden.setitem(sys.modules, "tokenizers", None)  # as installed without the hf extra
        save_dir, hf_dir = train_two_updates_and_export(None, "roberta_tiny", tmp_path)
    messages = [record.getMessage() for record in caplog.records]
    assert not [m for m in messages if "pip install" in m or "without tokenizer" in m or "no tokenizer" in m], messages
    assert (save_dir / "checkpoint_last" / "tokenizer" / "tokenizer.json").is_file()
    dictionary = Dictionary.load(corpus.builtin_corpus_dir() / "dict.txt")
    dictionary.add_symbol("<mask>")
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert len(auto) == len(dictionary) and auto.mask_token_id == dictionary.mask()
    text = "A default run's export reads text: naïve café 🐍"
    ids = auto(text)["input_ids"]
    assert ids == [dictionary.bos(), *ByteTokenizer(dictionary).encode(text), dictionary.eos()]
    assert auto.decode(ids, skip_special_tokens=True) == text


def test_byte_level_tokenizer_files_are_the_ones_tokenizers_writes(tmp_path, monkeypatch):
    """write_hf_tokenizer writes tokenizer.json itself (the default install has no
    tokenizers package): the tokenizers library reads it back as the very tokenizer its
    own API builds."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    from distlm.data import byte_dictionary, write_hf_tokenizer

    templates = {"masked_lm": ("<s> $A </s>", "<s> $A </s> </s> $B </s>"), "causal_lm": ("$A </s>", "$A </s> $B </s>")}
    for task, (single, pair) in templates.items():
        dictionary = byte_dictionary()
        if task == "masked_lm":
            dictionary.add_symbol("<mask>")
        with monkeypatch.context() as hidden:
            hidden.setitem(sys.modules, "tokenizers", None)
            write_hf_tokenizer(dictionary, tmp_path / task, task)
        ids = {symbol: index for index, symbol in enumerate(dictionary.symbols)}
        expected = Tokenizer(models.BPE(vocab=ids, merges=[], unk_token="<unk>", byte_fallback=True))
        specials = [symbol for symbol in SPECIALS if symbol in ids]
        expected.add_special_tokens([AddedToken(symbol, special=True, normalized=False) for symbol in specials])
        expected.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        used = [symbol for symbol in ("<s>", "</s>") if symbol in single]
        expected.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(symbol, ids[symbol]) for symbol in used])
        written = Tokenizer.from_file(str(tmp_path / task / "tokenizer.json"))
        assert written.to_str() == expected.to_str(), task


# --------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "case,expected",
    [
        ("no_tokenizer_json", "has no tokenizer.json"),
        ("missing_input", "cannot be read"),
        ("directory_input", "is a directory"),
        ("bad_json_line", "line 2 is not valid JSON"),
        ("unknown_json_key", "line 1 has no key 'body'"),
        ("out_is_a_file", "is a file"),
        ("not_utf8", "is not UTF-8"),
        ("no_documents", "holds no documents"),
        ("bad_fraction", "--valid-fraction"),
        ("unknown_flag", "unrecognized arguments"),
        ("lone_surrogate", "line 2: 'text' holds '\\ud800', a lone UTF-16 surrogate"),
        ("out_holds_dict_txt", "holds a dict.txt (a fairseq vocabulary)"),
        ("out_holds_another_tokenizer", "holds the data of another tokenizer"),
        ("bad_json_line_in_a_worker", "docs.jsonl line 2 is not valid JSON"),
        ("parquet_without_the_column", "docs.parquet has no column 'text' (its columns: 'id', 'body'); pass --text-key"),
        ("parquet_null_text", "docs.parquet row 1: 'text' is null, not text"),
        ("not_parquet", "docs.parquet is not a Parquet file"),
        ("no_workers", "--workers 0 must be at least 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(case, expected, tmp_path, tokenizer_dir, capsys):
    text = tmp_path / "docs.txt"
    text.write_text("one document\n\nanother one\n")
    jsonl = tmp_path / "docs.jsonl"
    args = {"--tokenizer": str(tokenizer_dir), "--input": str(text), "--out": str(tmp_path / "out")}
    extra: list[str] = []
    if case == "no_tokenizer_json":
        args["--tokenizer"] = str(tmp_path)
    elif case == "missing_input":
        args["--input"] = str(tmp_path / "nowhere.txt")
    elif case == "directory_input":
        args["--input"] = str(tmp_path)
    elif case == "bad_json_line":
        jsonl.write_text('{"text": "fine"}\n{"text": "broken\n')
        args["--input"] = str(jsonl)
    elif case == "unknown_json_key":
        jsonl.write_text('{"text": "fine"}\n')
        args["--input"] = str(jsonl)
        extra = ["--json-key", "body"]
    elif case == "out_is_a_file":
        args["--out"] = str(text)
    elif case == "not_utf8":
        text.write_bytes(b"caf\xe9\n")
    elif case == "no_documents":
        text.write_text("\n  \n\n")
    elif case == "bad_fraction":
        extra = ["--valid-fraction", "1.5"]
    elif case == "unknown_flag":
        extra = ["--shards", "3"]
    elif case == "lone_surrogate":
        jsonl.write_text('{"text": "fine"}\n{"text": "half a pair: \\ud800"}\n')
        args["--input"] = str(jsonl)
    elif case == "bad_json_line_in_a_worker":
        jsonl.write_text('{"text": "fine"}\n{"text": "broken\n')
        args["--input"] = f"{text} {jsonl}"
        extra = ["--workers", "2"]
    elif case.startswith("parquet"):
        pyarrow = pytest.importorskip("pyarrow")
        import pyarrow.parquet

        columns = {"id": [1, 2], "body": ["a", "b"]} if case == "parquet_without_the_column" else {"text": ["a", None]}
        pyarrow.parquet.write_table(pyarrow.table(columns), tmp_path / "docs.parquet")
        args["--input"] = str(tmp_path / "docs.parquet")
    elif case == "not_parquet":
        pytest.importorskip("pyarrow")
        (tmp_path / "docs.parquet").write_text('{"text": "JSON lines under the wrong name"}\n')
        args["--input"] = str(tmp_path / "docs.parquet")
    elif case == "no_workers":
        extra = ["--workers", "0"]
    elif case.startswith("out_holds"):
        (tmp_path / "out").mkdir()
        name = "dict.txt" if case == "out_holds_dict_txt" else "tokenizer.json"
        (tmp_path / "out" / name).write_text("another vocabulary\n")
    argv = [word for flag, value in args.items() for word in [flag, *value.split(" ")]] + extra
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distlm.data.prepare: error: "), captured.err
    assert expected in lines[0]
    assert not (tmp_path / "out" / "train.idx").exists()
    assert not list((tmp_path / "out").glob(".*partial*"))


@pytest.mark.parametrize(
    "case,expected",
    [
        ("vocab_size_too_small", "--vocab-size 260 is below 261: a byte-level tokenizer holds the 256 bytes"),
        ("unknown_tokenizer_model", "argument --tokenizer-model: invalid choice: 'wordpiece'"),
        ("training_flag_with_tokenizer", "--vocab-size set the tokenizer trained without --tokenizer; drop it"),
        ("no_tokenizers_package", "training a tokenizer (--input without --tokenizer) needs the tokenizers package; "
                                  "pip install 'distlm[hf]'"),
        ("out_holds_a_tokenizer_not_trained_here", "holds the data of a tokenizer not trained by distlm.prepare"),
    ],
)
def test_training_a_tokenizer_refuses_bad_input_in_one_line(case, expected, tmp_path, tokenizer_dir, capsys,
                                                            monkeypatch):
    text = tmp_path / "docs.txt"
    text.write_text("one document\n\nanother one\n")
    out = tmp_path / "out"
    argv = ["--input", str(text), "--out", str(out)]
    if case == "vocab_size_too_small":
        argv += ["--vocab-size", "260"]
    elif case == "unknown_tokenizer_model":
        argv += ["--tokenizer-model", "wordpiece"]
    elif case == "training_flag_with_tokenizer":
        argv += ["--tokenizer", str(tokenizer_dir), "--vocab-size", "400"]
    elif case == "no_tokenizers_package":
        monkeypatch.setitem(sys.modules, "tokenizers", None)
    elif case == "out_holds_a_tokenizer_not_trained_here":
        copy_tokenizer_files(tokenizer_dir, out)
    before = {path.name: path.read_bytes() for path in out.iterdir()} if out.exists() else {}
    assert prepare_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distlm.prepare: error: "), captured.err
    assert expected in lines[0]
    after = {path.name: path.read_bytes() for path in out.iterdir()} if out.exists() else {}
    assert after == before  # nothing written, nothing replaced


# ------------------------------------------------------------------------- constant memory

_MEMORY_PROBE = r'''
import json, resource, sys, tracemalloc
from pathlib import Path
import distlm.data.indexed_dataset as indexed
import distlm.data.prepare as prepare

root, tokenizer = Path(sys.argv[1]), sys.argv[2]
# Every buffer small, so that the larger corpus holds many of each.
prepare.ENCODE_BATCH, prepare.HELD_OUT_BLOCK, indexed.INDEX_CHUNK = 64, 512, 256
formats = ["txt", "jsonl"]
try:
    import pyarrow, pyarrow.parquet
    formats.append("parquet")
except ImportError:
    pass

def corpus(n, fmt):
    path = root / f"c{n}.{fmt}"
    texts = [f"w{i % 97} w{i % 89}" for i in range(n)]
    if fmt == "parquet":
        pyarrow.parquet.write_table(pyarrow.table({"text": texts}), path, row_group_size=256)
    else:
        path.write_text("".join(json.dumps({"text": t}) + "\n" if fmt == "jsonl" else t + "\n\n" for t in texts))
    return path

def traced_peak(path):
    tracemalloc.start()
    prepare.prepare(tokenizer, [path], root / f"out-{path.name}", progress=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak

traced_peak(corpus(100, "txt"))  # what a first run loads once (the tokenizer, pyarrow's first use)
corpora = {fmt: (corpus(1000, fmt), corpus(8000, fmt)) for fmt in formats}
out = {fmt: [traced_peak(small)] for fmt, (small, _) in corpora.items()}
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for fmt, (_, large) in corpora.items():
    out[fmt].append(traced_peak(large))
out["rss_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024
print(json.dumps(out))
'''


def test_prepare_runs_in_constant_memory_whatever_the_corpus_size(tokenizer_dir, tmp_path):
    """A corpus 8 times larger, holding many of every buffer prepare has (encode batches,
    Parquet record batches, the index's sizes, the held-out choice's blocks, all made small
    here), peaks at the same memory: no per-document state is kept (the index's sizes go to
    a file, the held-out choice is drawn block by block), and no file is read whole."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(tmp_path), str(tokenizer_dir)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    peaks = json.loads(done.stdout.splitlines()[-1])
    rss_growth = peaks.pop("rss_growth")
    for fmt, (small, large) in peaks.items():
        # Python's and numpy's allocations, traced exactly: 7,000 more documents kept at even
        # 8 bytes each would add 56 KB (the per-document index and held-out mask did, about 37
        # bytes a document); what remains differs by a few KB of allocator bookkeeping.
        assert large - small < 16 * 1024, (fmt, small, large)
    # The whole process, the tokenizer's own (Rust) memory and pyarrow's included: resident
    # peaks move by a few hundred KB between runs here; a corpus read whole would not fit in 8 MB.
    assert rss_growth < 8 * 2**20
