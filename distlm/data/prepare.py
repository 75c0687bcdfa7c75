"""``python -m distlm.prepare --input FILE ... --out DIR [--tokenizer HF_DIR]``: text to training data.

Tokenizes documents with a Hugging Face tokenizer (``HF_DIR/tokenizer.json``, read offline
by the ``tokenizers`` library) and writes a directory that ``--data DIR`` trains on:
``train.bin/.idx`` and ``valid.bin/.idx`` in Megatron's indexed layout (one sequence per
document), plus a copy of the tokenizer's files, which give the vocabulary.
``python -m distlm.data.prepare`` is the same command.

Without ``--tokenizer``, a byte-level BPE (or ``--tokenizer-model unigram``) tokenizer of
at most ``--vocab-size`` tokens is first trained on the training documents (see
:func:`distlm.data.hf_tokenizer.train_tokenizer`) and written beside the data; a rerun
into the same directory replaces the tokenizer it trained there, with all its data.

Input files are plain text, one document per paragraph (paragraphs are separated by
blank lines), JSON lines with the document's text under ``--text-key`` (files named
``*.jsonl``/``*.json``, or every file but Parquet when ``--text-key`` is given), or Parquet
files (``*.parquet``, read with pyarrow: ``pip install 'distlm[data]'``) with the text in the
``--text-key`` column. Files are streamed, JSON lines line by line and Parquet by record
batches, so memory does not grow with the text; ``--workers N`` reads and encodes N files
at a time, each into its own part, and the parts are joined in input order, so the output
does not depend on N. Each document is
encoded without the tokenizer's own special tokens, and the tokenizer's end-of-document
token (its eos) is appended, as ``fairseq-preprocess`` and Megatron's ``--append-eod`` do;
the training pipeline adds ``<s>`` for masked LMs. A special token's spelling inside a
document (say ``</s>``) is encoded as text. Empty documents are skipped.

``round(valid_fraction x documents)`` documents (at least one), chosen from ``--seed``
alone, become the validation split; ``--valid-fraction 0`` writes no validation split.
Memory does not grow with the corpus: files are read as streams, the index's sizes are
written to a file as they come, and the held-out choice is drawn block by block (:class:`HeldOut`).
The rest keep their input order in the training split, and only they train a tokenizer.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from distlm.choices import TOKENIZER_MODELS
from distlm.config import check_shared_settings
from distlm.data.hf_tokenizer import (
    CONFIG_FILES,
    DEFAULT_VOCAB_SIZE,
    TOKENIZER_FILE,
    TRAINED_KEY,
    HFVocabulary,
    check_tokenizer_training,
    copy_tokenizer_files,
    load_tokenizer,
    read_config_file,
    train_tokenizer,
)
from distlm.data.indexed_dataset import MEGATRON, IndexedDatasetBuilder, smallest_token_dtype
from distlm.errors import OneLineErrorParser, UsageError, first_line

SPLITS = ("train", "valid")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIX = ".parquet"
DEFAULT_TEXT_KEY = "text"
PLAIN, JSON_LINES, PARQUET = "text", "json", "parquet"
# Documents per encode_batch call: large enough for the tokenizer's threads to share,
# small enough to keep memory flat.
ENCODE_BATCH = 1024


def iter_documents(path: Path, json_key: str | None, file_format: str | None = None) -> Iterator[str]:
    """The documents of one input file, in order (``json_key`` None: plain text; a Parquet
    ``file_format``: the values of its ``json_key`` column)."""
    if file_format == PARQUET:
        yield from _parquet_texts(path, json_key)
        return
    try:
        handle = open(path, encoding="utf-8-sig")
    except IsADirectoryError:
        raise UsageError(f"--input {path} is a directory; name the text or JSON-lines files") from None
    except OSError as err:
        raise UsageError(f"--input {path} cannot be read ({err.strerror})") from None
    with handle:
        try:
            if json_key is None:
                yield from _paragraphs(handle)
            else:
                for line_number, line in enumerate(handle, start=1):
                    if line.strip():
                        yield _json_text(line, json_key, path, line_number)
        except UnicodeDecodeError as err:
            raise UsageError(f"--input {path} is not UTF-8 text ({err.reason}); convert it to UTF-8") from None


def _paragraphs(lines: Iterator[str]) -> Iterator[str]:
    """Runs of non-blank lines, without their final newline."""
    paragraph: list[str] = []
    for line in lines:
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).removesuffix("\n")
            paragraph = []
    if paragraph:
        yield "".join(paragraph).removesuffix("\n")


def _json_text(line: str, key: str, path: Path, line_number: int) -> str:
    where = f"--input {path} line {line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(
            f"{where} is not valid JSON ({err.msg} at column {err.colno}); JSON lines hold one object per line"
        ) from None
    if not isinstance(record, dict):
        raise UsageError(f"{where} is a JSON {type(record).__name__}, not an object with a {key!r} key")
    if key not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise UsageError(f"{where} has no key {key!r} (its keys: {keys}); pass --json-key with the text's key")
    text = record[key]
    if not isinstance(text, str):
        raise UsageError(f"{where}: {key!r} holds a JSON {type(text).__name__}, not a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate escape such as \ud800, which no tokenizer takes
        raise UsageError(f"{where}: {key!r} holds {err.object[err.start:err.end]!r}, a lone UTF-16 surrogate "
                         "and not text; fix the escape in that line") from None
    return text


def _parquet_texts(path: Path, key: str) -> Iterator[str]:
    """The ``key`` column of a Parquet file, one record batch at a time."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UsageError(f"--input {path} is Parquet, which needs pyarrow; pip install 'distlm[data]'") from None
    try:
        parquet = pyarrow.parquet.ParquetFile(path)
    except IsADirectoryError:
        raise UsageError(f"--input {path} is a directory; name the Parquet files in it") from None
    except OSError as err:
        raise UsageError(f"--input {path} cannot be read ({err.strerror})") from None
    except pyarrow.ArrowException as err:
        raise UsageError(f"--input {path} is not a Parquet file ({first_line(err)}); name it after its format") from None
    schema = parquet.schema_arrow
    if key not in schema.names:
        columns = ", ".join(map(repr, schema.names[:8])) or "none"
        raise UsageError(f"--input {path} has no column {key!r} (its columns: {columns}); "
                         f"pass --text-key with the text's column")
    column_type = schema.field(key).type
    if not (pyarrow.types.is_string(column_type) or pyarrow.types.is_large_string(column_type)):
        raise UsageError(f"--input {path}: column {key!r} holds {column_type}, not strings; "
                         f"pass --text-key with the text's column")
    row = 0
    for batch in parquet.iter_batches(batch_size=ENCODE_BATCH, columns=[key]):
        texts = batch.column(0).to_pylist()
        if None in texts:
            raise UsageError(f"--input {path} row {row + texts.index(None)}: {key!r} is null, not text; "
                             f"drop or fill that row")
        yield from texts
        row += len(texts)


def check_out_vocabulary(out: Path, tokenizer_dir: Path | None) -> None:
    """Refuse an ``out`` that already holds another vocabulary: training reads a ``dict.txt``
    before a tokenizer, and an export would ship the tokenizer found there. A tokenizer is
    about to be trained when ``tokenizer_dir`` is None: it may replace only one trained there
    before, whose files and data are all rewritten."""
    source = "the tokenizer to train" if tokenizer_dir is None else f"the tokenizer of {tokenizer_dir}"
    if (out / "dict.txt").exists():
        raise UsageError(f"--out {out} holds a dict.txt (a fairseq vocabulary), which training would read instead "
                         f"of {source}; name a new or empty directory")
    existing = out / TOKENIZER_FILE
    if not existing.is_file():
        return
    if tokenizer_dir is None:
        if TRAINED_KEY not in read_config_file(out / CONFIG_FILES[0]):
            raise UsageError(f"--out {out} holds the data of a tokenizer not trained by distlm.prepare; name a new "
                             f"or empty directory, or pass that tokenizer with --tokenizer {out}")
        return
    ours = tokenizer_dir / TOKENIZER_FILE
    if ours.is_file() and existing.read_bytes() != ours.read_bytes():
        raise UsageError(f"--out {out} holds the data of another tokenizer ({TOKENIZER_FILE} differs from "
                         f"{tokenizer_dir}'s); name a new or empty directory")


def input_format(path: Path, text_key: str | None) -> tuple[str, str | None]:
    """How to read ``path`` (plain text, JSON lines or Parquet), and the key of its text."""
    suffix = path.suffix.lower()
    if suffix == PARQUET_SUFFIX:
        return PARQUET, text_key or DEFAULT_TEXT_KEY
    if text_key is not None:
        return JSON_LINES, text_key
    return (JSON_LINES, DEFAULT_TEXT_KEY) if suffix in JSON_SUFFIXES else (PLAIN, None)


def file_documents(path: Path, text_key: str | None) -> Iterator[str]:
    """The non-empty documents of one input, in order."""
    file_format, key = input_format(path, text_key)
    for document in iter_documents(path, key, file_format):
        if document.strip():
            yield document


def all_documents(inputs: Sequence[Path], text_key: str | None) -> Iterator[str]:
    """Every non-empty document of every input, in order."""
    for path in inputs:
        yield from file_documents(path, text_key)


HELD_OUT_BLOCK = 1 << 16
"""Documents whose held-out choice is drawn at a time: that choice's memory, whatever the corpus size."""
# Keeps the held-out draw apart from other seeded streams.
_HELD_OUT_STREAM = 0x56414C44
# numpy draws hypergeometric numbers of held-out and kept documents below this each.
_HYPERGEOMETRIC_LIMIT = 10**9


class HeldOut:
    """Which of ``num_documents`` documents (or of the window ``start:stop`` of them) are held
    out for validation: ``round(valid_fraction x num_documents)`` (at least one when the
    fraction is positive), a uniformly drawn subset fixed by ``seed`` alone, so a rerun holds
    out the same ones.

    Drawn in constant memory, whatever the corpus size: the documents fall into blocks of
    ``HELD_OUT_BLOCK``; a chain of hypergeometric draws from the seed gives each block its
    number of held-out documents (as many as a uniform subset puts there), and a draw seeded
    by the block picks which. Reading the documents in order walks the chain once.
    """

    def __init__(self, num_documents: int, valid_fraction: float, seed: int, start: int = 0,
                 stop: int | None = None) -> None:
        self.total, self.valid_fraction, self.seed = num_documents, valid_fraction, seed
        self.count = 0 if valid_fraction == 0 else max(1, round(valid_fraction * num_documents))
        if self.count and self.count >= num_documents:
            raise UsageError(
                f"--valid-fraction {valid_fraction} of {num_documents} documents leaves none for training; "
                f"give more documents or a smaller --valid-fraction"
            )
        if max(self.count, num_documents - self.count) >= _HYPERGEOMETRIC_LIMIT:
            raise UsageError(f"--input holds {num_documents:,} documents, more than one prepare splits into train "
                             f"and valid; prepare the files in several runs of fewer than {_HYPERGEOMETRIC_LIMIT:,}")
        self.start, self.stop = start, num_documents if stop is None else stop
        self._chain: tuple | None = None
        self._block: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def window(self, start: int, stop: int) -> "HeldOut":
        """The same choice, for documents ``start:stop`` of this window."""
        return HeldOut(self.total, self.valid_fraction, self.seed, self.start + start, self.start + stop)

    def mask(self, start: int, stop: int) -> np.ndarray:
        """Whether each document ``start:stop`` of this window is held out."""
        first, last = self.start + start, self.start + stop
        parts = [self._block_mask(block)[max(first - block * HELD_OUT_BLOCK, 0):last - block * HELD_OUT_BLOCK]
                 for block in range(first // HELD_OUT_BLOCK, -(-last // HELD_OUT_BLOCK))]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)

    def flags(self) -> Iterator[bool]:
        """Whether each document of this window is held out, in order."""
        for start in range(0, len(self), HELD_OUT_BLOCK):
            yield from self.mask(start, min(start + HELD_OUT_BLOCK, len(self))).tolist()

    def _block_mask(self, block: int) -> np.ndarray:
        if self._block is None or self._block[0] != block:
            size = min(HELD_OUT_BLOCK, self.total - block * HELD_OUT_BLOCK)
            chosen = np.zeros(size, dtype=bool)
            chosen[np.random.default_rng([_HELD_OUT_STREAM, self.seed, block]).choice(
                size, self._block_count(block), replace=False)] = True
            self._block = (block, chosen)
        return self._block[1]

    def _block_count(self, block: int) -> int:
        """Held-out documents in ``block``: the chain's draw for it (walked from the start again
        only when asked for an earlier block)."""
        if self._chain is not None and self._chain[0] == block + 1:
            return self._chain[4]
        if self._chain is None or self._chain[0] > block:
            self._chain = (0, np.random.default_rng([_HELD_OUT_STREAM, self.seed]), self.total, self.count, 0)
        index, rng, left, held, drawn = self._chain
        while index <= block:
            size = min(HELD_OUT_BLOCK, left)
            drawn = int(rng.hypergeometric(held, left - held, size)) if size < left else held
            index, left, held = index + 1, left - size, held - drawn
        self._chain = (index, rng, left, held, drawn)
        return drawn


def choose_valid_documents(num_documents: int, valid_fraction: float, seed: int) -> np.ndarray:
    """A boolean mask of the documents held out for validation (see :class:`HeldOut`)."""
    return HeldOut(num_documents, valid_fraction, seed).mask(0, num_documents)


def prepare(
    tokenizer_dir: str | os.PathLike | None,
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    text_key: str | None = None,
    valid_fraction: float = 0.01,
    seed: int = 1,
    progress: bool = True,
    tokenizer_model: str = TOKENIZER_MODELS[0],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    workers: int = 1,
) -> dict:
    """Tokenize ``inputs`` into ``out_dir`` (see the module docstring); return per-split counts.

    ``tokenizer_dir`` None trains a ``tokenizer_model`` tokenizer of at most ``vocab_size``
    tokens on the training documents first. ``workers`` processes read and encode the files.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise UsageError(f"--valid-fraction {valid_fraction} must be in [0, 1)")
    check_shared_settings({"seed": seed})  # within --seed's bounds (distlm.config)
    if text_key is not None and not text_key:
        raise UsageError("--text-key must not be empty")
    if workers < 1:
        raise UsageError(f"--workers {workers} must be at least 1")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; name a directory to write the data into")
    check_out_vocabulary(out, None if tokenizer_dir is None else Path(tokenizer_dir))
    if tokenizer_dir is None:
        check_tokenizer_training(tokenizer_model, vocab_size)
    else:
        loaded = _load_tokenizer(Path(tokenizer_dir))  # a bad tokenizer is refused before the text is read
    paths = [Path(path) for path in inputs]
    started = time.perf_counter()
    # No more processes than files: a file is one worker's.
    with _Workers(min(workers, len(paths))) as pool:
        # First pass: count (and validate) every document before anything is written.
        counts = list(pool.map(_count_file, [(path, text_key) for path in paths]))
        num_documents = sum(counts)
        if num_documents == 0:
            raise UsageError(f"--input {' '.join(map(str, paths))} holds no documents; check the files and "
                             f"--text-key")
        is_valid = HeldOut(num_documents, valid_fraction, seed)
        files = _FileSet(paths, text_key, counts, is_valid)

        if tokenizer_dir is not None:
            stats = _write_data(Path(tokenizer_dir), loaded, files, out, progress, pool)
        else:
            with tempfile.TemporaryDirectory(prefix="distlm-tokenizer-") as trained:
                training = (doc for doc, held_out in zip(all_documents(paths, text_key), is_valid.flags())
                            if not held_out)
                train_tokenizer(training, trained, tokenizer_model, vocab_size)
                stats = _write_data(Path(trained), _load_tokenizer(Path(trained)), files, out, progress, pool)
            stats["trained"] = tokenizer_model
    stats["seconds"] = time.perf_counter() - started
    stats["input_bytes"] = sum(path.stat().st_size for path in paths)
    return stats


class _FileSet:
    """The inputs with their document counts, and which of their documents are held out."""

    def __init__(self, paths: list[Path], text_key: str | None, counts: list[int], is_valid: HeldOut) -> None:
        self.paths, self.text_key, self.is_valid = paths, text_key, is_valid
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()

    def task(self, index: int, tokenizer_dir: Path, part_prefix: str, splits: list[str], dtype: np.dtype) -> tuple:
        held_out = self.is_valid.window(self.starts[index], self.starts[index + 1])
        return self.paths[index], self.text_key, held_out, tokenizer_dir, part_prefix, splits, dtype


class _Workers:
    """``workers`` processes for the files, or this process alone for 1.

    A ``concurrent.futures`` pool, because it reports a worker that died (killed, out of
    memory) where ``multiprocessing.Pool`` waits for its task forever. Its processes are
    forked: a spawned one would import distlm.data, and with it torch, again (over a second
    each). On an error the workers stop at their next batch and remove the parts they wrote.
    """

    def __init__(self, workers: int) -> None:
        self.executor = None
        if workers > 1:
            context = multiprocessing.get_context("fork")
            self.progress, self.stop = context.Value("q", 0), context.Value("b", 0)
            self.executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                                initargs=(self.progress, self.stop))

    def map(self, function, tasks: list) -> Iterator:
        """``function`` over ``tasks``, results in order."""
        return map(function, tasks) if self.executor is None else self.executor.map(function, tasks)

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.shut_down(stop=exc_type is not None)

    def shut_down(self, stop: bool) -> None:
        """Wait for the workers to end, after asking them to stop at their next batch with ``stop``."""
        if self.executor is not None:
            if stop:
                self.stop.value = 1
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None


# Set in each worker process by _start_worker.
_worker_state: tuple = ()
_worker_tokenizers: dict = {}


def _start_worker(progress, stop) -> None:
    global _worker_state
    _worker_state = (progress, stop)
    # The processes are the parallelism: tokenizers' own threads in each would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _stop_if_asked() -> None:
    if _worker_state and _worker_state[1].value:
        raise UsageError("stopped: another file failed")


def _count_file(task: tuple) -> int:
    path, text_key = task
    count = 0
    for count, _ in enumerate(file_documents(path, text_key), start=1):
        if count % ENCODE_BATCH == 0:
            _stop_if_asked()
    return count


def _load_tokenizer(tokenizer_dir: Path) -> tuple:
    """The tokenizer of ``tokenizer_dir`` set to encode documents, its vocabulary and its eos id."""
    tokenizer = load_tokenizer(tokenizer_dir)
    vocabulary = HFVocabulary.load(tokenizer_dir, tokenizer=tokenizer)
    eos = vocabulary.require("eos", "prepare (to end every document)")
    # A "</s>" typed in a document is text, not the end of the document.
    tokenizer.encode_special_tokens = True
    return tokenizer, vocabulary, eos


def _write_data(tokenizer_dir: Path, loaded: tuple, files: _FileSet, out: Path, progress: bool, pool) -> dict:
    """The second pass: every document encoded into its split under ``out``, then the tokenizer's files."""
    _, vocabulary, _ = loaded
    is_valid = files.is_valid
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {out} cannot be created ({err.strerror})") from None
    dtype = smallest_token_dtype(len(vocabulary))
    # Written under temporary names and renamed at the end: an interrupted run never
    # leaves a split that looks complete.
    splits = [split for split in SPLITS if split == "train" or is_valid.count]
    builders = {split: IndexedDatasetBuilder(out / f".{split}.partial", dtype, flavour=MEGATRON) for split in splits}
    try:
        _tokenize(loaded, files, tokenizer_dir, out, dtype, builders, progress, pool)
    except BaseException:
        for builder in builders.values():
            builder.close()
        for split in SPLITS:
            for part in out.glob(f".{split}.partial*"):
                part.unlink(missing_ok=True)
        raise
    previous, ours = out / TOKENIZER_FILE, tokenizer_dir / TOKENIZER_FILE
    if previous.is_file() and not previous.samefile(ours) and previous.read_bytes() != ours.read_bytes():
        # A tokenizer trained here before: gone before its data is replaced, so that a run
        # stopped in between leaves a directory no training reads, not data under the wrong tokenizer.
        previous.unlink()
    stats: dict = {"documents": len(is_valid), "dtype": dtype.name, "vocab_size": len(vocabulary)}
    for split, builder in builders.items():
        builder.finish()
        for suffix in (".bin", ".idx"):
            os.replace(builder.prefix + suffix, out / f"{split}{suffix}")
        stats[split] = {"documents": len(builder), "tokens": builder.num_tokens}
    if "valid" not in builders:
        for suffix in (".bin", ".idx"):
            (out / f"valid{suffix}").unlink(missing_ok=True)  # an earlier run's, which no longer belongs
    stats["tokens"] = sum(stats[split]["tokens"] for split in splits)
    copy_tokenizer_files(tokenizer_dir, out)
    return stats


def _tokenize(loaded: tuple, files: _FileSet, tokenizer_dir: Path, out: Path, dtype: np.dtype, builders: dict,
              progress: bool, pool) -> None:
    from tqdm import tqdm

    with tqdm(total=len(files.is_valid), unit="doc", disable=not progress, file=sys.stderr) as bar:
        if pool.executor is None:
            for index in range(len(files.paths)):
                path, text_key, held_out, *_ = files.task(index, tokenizer_dir, "", [], dtype)
                _encode_file(loaded, path, text_key, held_out, builders, bar.update)
            return
        splits = list(builders)
        tasks = [files.task(index, tokenizer_dir, os.fspath(out / f".{{split}}.partial.{index}"), splits, dtype)
                 for index in range(len(files.paths))]
        try:
            _join_parts(pool, tasks, builders, bar)
        except BaseException:
            pool.shut_down(stop=True)  # before the caller removes the parts, so that no worker writes one after
            raise


def _join_parts(pool: _Workers, tasks: list, builders: dict, bar) -> None:
    futures = [pool.executor.submit(_encode_part, task) for task in tasks]
    for task, future in zip(tasks, futures):
        while not wait([future], timeout=0.2).done:
            bar.update(pool.progress.value - bar.n)
        try:
            future.result()
        except BrokenProcessPool:
            raise UsageError(f"a --workers process died while it encoded {task[0]} (killed, or out of memory?); "
                             f"rerun, with fewer --workers if memory is short") from None
        # Joined in input order, so the data is the one a single process writes.
        for split, builder in builders.items():
            part = task[4].format(split=split)
            builder.merge(part)
            for suffix in (".bin", ".idx"):
                Path(part + suffix).unlink()
    bar.update(pool.progress.value - bar.n)


def _encode_part(task: tuple) -> None:
    """In a worker: one file encoded into its own finished part of each split."""
    path, text_key, held_out, tokenizer_dir, part_prefix, splits, dtype = task
    if tokenizer_dir not in _worker_tokenizers:
        _worker_tokenizers.clear()
        _worker_tokenizers[tokenizer_dir] = _load_tokenizer(tokenizer_dir)
    builders = {split: IndexedDatasetBuilder(part_prefix.format(split=split), dtype, flavour=MEGATRON)
                for split in splits}

    def report(count: int) -> None:
        with _worker_state[0].get_lock():
            _worker_state[0].value += count
        _stop_if_asked()

    try:
        _encode_file(_worker_tokenizers[tokenizer_dir], path, text_key, held_out, builders, report)
    except BaseException:
        for builder in builders.values():
            builder.close()
            for suffix in (".bin", ".idx"):
                Path(builder.prefix + suffix).unlink(missing_ok=True)
        raise
    for builder in builders.values():
        builder.finish()


def _encode_file(loaded: tuple, path: Path, text_key: str | None, held_out: HeldOut, builders: dict,
                 report) -> None:
    """Every document of ``path`` encoded, with the eos appended, into its split's builder."""
    tokenizer, _, eos = loaded
    eos_array = np.array([eos])
    number = 0
    batch: list[str] = []
    for document in itertools.chain(file_documents(path, text_key), [None]):
        if document is not None:
            batch.append(document)
        if batch and (len(batch) == ENCODE_BATCH or document is None):
            if number + len(batch) > len(held_out):
                raise UsageError(f"--input {path} changed while it was read (more documents than counted); rerun")
            for encoding, valid in zip(tokenizer.encode_batch(batch, add_special_tokens=False),
                                       held_out.mask(number, number + len(batch))):
                builders["valid" if valid else "train"].add(
                    np.concatenate([np.asarray(encoding.ids, dtype=np.int64), eos_array]))
            number += len(batch)
            report(len(batch))
            batch = []
    if number != len(held_out):
        raise UsageError(f"--input {path} changed while it was read ({len(held_out)} documents, then {number}); rerun")


def main(argv: Sequence[str] | None = None, prog: str = "python -m distlm.data.prepare") -> int:
    parser = OneLineErrorParser(
        prog=prog,
        description="Tokenize text, JSON-lines or Parquet files into a directory that --data trains on (train/valid "
        ".bin/.idx in Megatron's layout, plus the tokenizer's files), with a Hugging Face tokenizer or, "
        "without --tokenizer, one trained on the text.",
    )
    parser.add_argument("--tokenizer", metavar="HF_DIR",
                        help="Hugging Face tokenizer directory (default: train one on the training documents)")
    parser.add_argument("--input", required=True, nargs="+", metavar="FILE", help="text, JSON-lines (*.jsonl) or Parquet (*.parquet) files")
    parser.add_argument("--out", required=True, metavar="DIR", help="output data directory")
    parser.add_argument(
        "--text-key", "--json-key", dest="text_key", metavar="KEY",
        help=f"the text's key in JSON lines and column in Parquet (default {DEFAULT_TEXT_KEY!r}); given, every "
        f"input not named *.parquet is read as JSON lines (default: those named *.jsonl/*.json)",
    )
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="processes that read and encode the files, one file each at a time (default 1)")
    parser.add_argument("--valid-fraction", type=float, default=0.01, help="share of documents held out (default 0.01)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the validation choice (default 1)")
    parser.add_argument("--tokenizer-model", choices=TOKENIZER_MODELS,
                        help=f"without --tokenizer: the byte-level tokenizer to train (default {TOKENIZER_MODELS[0]})")
    parser.add_argument("--vocab-size", type=int,
                        help=f"without --tokenizer: the trained tokenizer's largest size (default {DEFAULT_VOCAB_SIZE})")
    command = prog.split()[-1]
    try:
        args = parser.parse_args(argv)
        training = {"tokenizer_model": args.tokenizer_model, "vocab_size": args.vocab_size}
        given = [f"--{name.replace('_', '-')}" for name, value in training.items() if value is not None]
        if args.tokenizer is not None and given:
            raise UsageError(f"{' and '.join(given)} set the tokenizer trained without --tokenizer; drop "
                             f"{'them' if len(given) > 1 else 'it'} or --tokenizer {args.tokenizer}")
        stats = prepare(args.tokenizer, args.input, args.out, args.text_key, args.valid_fraction, args.seed,
                        workers=args.workers,
                        **{name: value for name, value in training.items() if value is not None})
    except UsageError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return UsageError.exit_code
    if "trained" in stats:
        print(f"tokenizer: {stats['trained']}, {stats['vocab_size']} tokens, trained on the training split and "
              f"written to {args.out}")
    for split in SPLITS:
        if split in stats:
            print(f"{split}: {stats[split]['documents']} documents, {stats[split]['tokens']} tokens ({stats['dtype']})")
    seconds = max(stats["seconds"], 1e-9)
    print(
        f"wrote {args.out} in {stats['seconds']:.1f} s: {stats['documents'] / seconds:,.0f} documents/s, "
        f"{stats['tokens'] / seconds:,.0f} tokens/s, {stats['input_bytes'] / seconds / 1e6:.2f} MB/s of input"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
