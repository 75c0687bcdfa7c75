"""``python -m distlm.data.prepare`` and training on its output with a Hugging Face tokenizer.

A small byte-level BPE tokenizer is trained here with the ``tokenizers`` library on the
standard library's prose (the built-in corpus's source), so the reference encodings and
decodings come from that library, not from distlm.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from distlm.data import MMapIndexedDataset, load_lm_data  # noqa: E402
from distlm.data import corpus  # noqa: E402
from distlm.data.hf_tokenizer import HFVocabulary, save_tokenizer  # noqa: E402
from distlm.data.prepare import main, prepare  # noqa: E402
from distlm.errors import UsageError  # noqa: E402

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

    # --json-key reads any file name as JSON lines, under that key.
    renamed = tmp_path / "docs.data"
    renamed.write_text("".join(json.dumps({"body": doc}) + "\n" for doc in documents))
    prepare(tokenizer_dir, [renamed], tmp_path / "key", json_key="body", valid_fraction=VALID_FRACTION, seed=4,
            progress=False)
    assert (tmp_path / "key" / "train.bin").read_bytes() != (out / "train.bin").read_bytes()
    together = sorted(s.tobytes() for split in ("train", "valid") for s in read_split(tmp_path / "key", split))
    assert together == sorted(s.tobytes() for split in ("train", "valid") for s in read_split(out, split))


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


@pytest.mark.parametrize("arch", ["llama_tiny", "roberta_tiny"])
def test_exported_tokenizer_encodes_text_as_the_data_pipeline_did(arch, prepared, reference, tokenizer_dir, tmp_path):
    """prepare -> 2 updates -> ``python -m distlm.export --hf``: the export carries the
    tokenizer, and transformers' AutoTokenizer of it encodes a document's text to the ids
    the pipeline wrote for it (less the end-of-document token it appends, which is not
    part of the text) and to exactly the ids the model saw for it: for a causal LM the
    text alone (neither side adds a bos), for a masked LM ``<s>`` text ``</s>``."""
    transformers = pytest.importorskip("transformers")
    from distlm.config import parse_args
    from distlm.export import main as export_main
    from distlm.trainer import Trainer

    out, _ = prepared
    save_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    Trainer(parse_args([
        "--data", str(out), "--arch", arch, "--tokens-per-sample", "32", "--batch-size", "2", "--max-update", "2",
        "--disable-validation", "--save-dir", str(save_dir), "--device", "cpu", "--log-interval", "1000",
    ])).fit()
    assert export_main(["--checkpoint", str(save_dir), "--hf", str(hf_dir)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf_dir / name).read_bytes() == (tokenizer_dir / name).read_bytes()
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)

    task = "causal_lm" if arch == "llama_tiny" else "masked_lm"
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
        extra = ["--vocab-size", "3"]
    elif case == "lone_surrogate":
        jsonl.write_text('{"text": "fine"}\n{"text": "half a pair: \\ud800"}\n')
        args["--input"] = str(jsonl)
    elif case.startswith("out_holds"):
        (tmp_path / "out").mkdir()
        name = "dict.txt" if case == "out_holds_dict_txt" else "tokenizer.json"
        (tmp_path / "out" / name).write_text("another vocabulary\n")
    argv = [item for pair in args.items() for item in pair] + extra
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distlm.data.prepare: error: "), captured.err
    assert expected in lines[0]
    assert not (tmp_path / "out" / "train.idx").exists()
