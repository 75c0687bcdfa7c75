"""The built-in corpus: English prose that ships with every Python installation.

It is gathered from the standard library's own documentation: the docstrings and block
comments of its ``.py`` files (read with ``ast`` and line scanning, never imported), plus
the language reference topics in ``pydoc_data.topics``. Nothing is downloaded and no
tokens are random, so loss curves mean something out of the box.

The corpus is built once into a user cache directory as a ``fairseq-preprocess`` style
directory (``dict.txt``, ``train.bin/.idx``, ``valid.bin/.idx``). From then on it goes
through exactly the same reader as user data.

Print its size with ``python -m distlm.data.corpus``.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from distlm.data.indexed_dataset import write_indexed_dataset
from distlm.data.tokenizer import NUM_BYTES, ByteTokenizer, byte_dictionary
from distlm.errors import UsageError

logger = logging.getLogger(__name__)

# Bump when the extraction or the on-disk format changes, so stale caches are not reused.
CORPUS_FORMAT_VERSION = 1
# Every VALID_EVERY-th paragraph is held out for validation (about 1.6 %).
VALID_EVERY = 64
STATS_FILE = "corpus.json"
CORPUS_FILES = ("dict.txt", "train.bin", "train.idx", "valid.bin", "valid.idx", STATS_FILE)
# Test suites and vendored packages are not the standard library's own prose.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
# Below this, the stdlib sources are probably missing (some distributions ship only .pyc).
_MIN_TEXT_BYTES = 256 * 1024

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def cache_root() -> Path:
    """``$DISTLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/distlm``, else ``~/.cache/distlm``."""
    if os.environ.get("DISTLM_CACHE_DIR"):
        return Path(os.environ["DISTLM_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "distlm"
    return Path.home() / ".cache" / "distlm"


def builtin_corpus_dir(root: Path | None = None) -> Path:
    """Where this interpreter's corpus lives (it may not be built yet).

    The name carries the Python version and a hash of the full build string, because two
    builds of one version can patch their stdlib differently, and every rank of a
    multi-node job must read identical data.
    """
    root = cache_root() if root is None else Path(root)
    build = hashlib.sha256(sys.version.encode()).hexdigest()[:8]
    version = ".".join(map(str, sys.version_info[:3]))
    return root / f"stdlib-corpus-v{CORPUS_FORMAT_VERSION}-py{version}-{build}"


def ensure_builtin_corpus(root: Path | None = None) -> Path:
    """Return the built corpus directory, building it on first use.

    Several processes (every rank of a torchrun job) may call this at once. One builds
    under an exclusive ``flock`` into a temporary directory and renames it into place,
    so nobody ever sees a half-written corpus. The others wait on the lock, then find it
    built.
    """
    target = builtin_corpus_dir(root)
    if _is_complete(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f"{target.name}.lock", "a+")
    except OSError as err:
        raise UsageError(
            f"cannot create the corpus cache in {target.parent} ({err.strerror}); "
            f"set DISTLM_CACHE_DIR to a writable directory"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):
            return target
        if target.exists():
            # A directory without its final file was damaged after the fact; start over.
            shutil.rmtree(target)
        building = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
        try:
            logger.info("building the built-in corpus from the Python standard library into %s (one time)", target)
            started = time.perf_counter()
            stats = _build(building)
            building.chmod(0o755)
            os.replace(building, target)
            logger.info(
                "built-in corpus ready: %.2f MB of text, %d tokens, in %.1f s",
                stats["text_bytes"] / 1e6,
                stats["tokens"],
                time.perf_counter() - started,
            )
        finally:
            if building.exists():
                shutil.rmtree(building, ignore_errors=True)
    return target


def corpus_stats(root: Path | None = None) -> dict:
    """Size of the built-in corpus (building it if needed): bytes of text, tokens, sentences."""
    directory = ensure_builtin_corpus(root)
    stats = json.loads((directory / STATS_FILE).read_text(encoding="utf-8"))
    stats["path"] = str(directory)
    return stats


def _is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in CORPUS_FILES)


def iter_stdlib_paragraphs() -> Iterator[tuple[str, str]]:
    """Yield ``(source, paragraph)`` in a fixed order: per stdlib file, then pydoc topics."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (path for path in stdlib.rglob("*.py") if not _SKIPPED_DIRS.intersection(path.relative_to(stdlib).parts)),
        key=lambda path: path.relative_to(stdlib).as_posix(),
    )
    for path in files:
        try:
            source = path.read_bytes()
            tree = ast.parse(source)
        except (OSError, SyntaxError, ValueError):
            continue  # a file this interpreter cannot parse holds no usable prose
        for docstring in _docstrings(tree):
            for paragraph in _split_paragraphs(docstring):
                yield "docstrings", paragraph
        for comment in _comment_blocks(source.decode("utf-8", errors="replace")):
            yield "comments", comment
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for name in sorted(topics):
        for paragraph in _split_paragraphs(topics[name]):
            yield "pydoc_topics", paragraph


def _docstrings(tree: ast.Module) -> Iterator[str]:
    """Docstrings of the module and of every class and function, in source order."""

    def visit(body: list[ast.stmt]) -> Iterator[str]:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring:
                    yield docstring
            # Definitions also hide inside if/try/with blocks; walking only statement
            # lists (not every expression, as ast.walk would) keeps this fast.
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from visit(children)

    module_docstring = ast.get_docstring(tree)
    if module_docstring:
        yield module_docstring
    yield from visit(tree.body)


def _comment_blocks(source: str) -> Iterator[str]:
    """Runs of whole-line ``#`` comments, each joined into one paragraph."""
    block: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        text = stripped[1:].strip(" #") if stripped.startswith("#") else ""
        if text and not stripped.startswith(("#!", "# -*-")):
            block.append(text)
            continue
        if block:
            yield " ".join(block)
            block = []
    if block:
        yield " ".join(block)


def _split_paragraphs(text: str) -> Iterator[str]:
    for paragraph in _PARAGRAPH_BREAK.split(text):
        paragraph = "\n".join(line.rstrip() for line in paragraph.strip("\n").splitlines()).strip()
        if paragraph:
            yield paragraph


def looks_like_prose(text: str) -> bool:
    """Mostly words: code samples, tables and rulers are filtered out."""
    if len(text) < 20 or len(text.split()) < 4:
        return False
    letters_and_spaces = sum(1 for char in text if char.isalpha() or char == " ")
    return letters_and_spaces >= 0.7 * len(text)


def _build(directory: Path) -> dict:
    """Write the corpus files into ``directory`` and return its statistics."""
    seen: set[str] = set()
    splits: dict[str, list[bytes]] = {"train": [], "valid": []}
    source_bytes: dict[str, int] = {}
    for source, paragraph in iter_stdlib_paragraphs():
        # Many short docstrings repeat verbatim ("Return self==value."); keep one copy.
        if paragraph in seen or not looks_like_prose(paragraph):
            continue
        seen.add(paragraph)
        encoded = paragraph.encode("utf-8")
        split = "valid" if len(seen) % VALID_EVERY == 0 else "train"
        splits[split].append(encoded)
        source_bytes[source] = source_bytes.get(source, 0) + len(encoded)

    text_bytes = sum(source_bytes.values())
    if text_bytes < _MIN_TEXT_BYTES:
        raise UsageError(
            f"the Python standard library at {sysconfig.get_paths()['stdlib']} yields only {text_bytes} bytes of "
            f"documentation (are its .py sources installed?); pass a fairseq-preprocess data directory instead"
        )

    # fairseq counts symbols on the training split only.
    train_bytes = np.frombuffer(b"".join(splits["train"]), dtype=np.uint8)
    dictionary = byte_dictionary(np.bincount(train_bytes, minlength=NUM_BYTES))
    dictionary.save(directory / "dict.txt")
    tokenizer = ByteTokenizer(dictionary)
    eos = np.array([dictionary.eos()])

    stats: dict = {
        "format_version": CORPUS_FORMAT_VERSION,
        "python": sys.version,
        "text_bytes": text_bytes,
        "source_text_bytes": source_bytes,
        "vocab_size": len(dictionary),
    }
    for split, paragraphs in splits.items():
        sequences = (np.concatenate([tokenizer.encode_bytes(text), eos]) for text in paragraphs)
        write_indexed_dataset(directory / split, sequences, dtype=np.uint16)
        split_text = sum(map(len, paragraphs))
        stats[split] = {"sentences": len(paragraphs), "text_bytes": split_text, "tokens": split_text + len(paragraphs)}
    stats["tokens"] = stats["train"]["tokens"] + stats["valid"]["tokens"]
    # Written last: its presence is what marks a corpus directory as complete.
    (directory / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stats
