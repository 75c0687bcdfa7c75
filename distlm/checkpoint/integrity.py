"""Checksums of a checkpoint's files, and the identity of a checkpoint while it is read.

At a save every rank hashes the files it wrote (its shards; rank 0 also DCP's metadata
and the tokenizer files) and rank 0 records name, size and checksum of each under
``files`` in ``distlm.json``. DCP's files are hashed as their bytes are written
(``HashingWriter``), not read back. The checksum is CRC-32 (zlib's): on this kind of machine it
ran at 3.9 GB/s on one core against 1.5 GB/s for SHA-256, the fastest of hashlib's (the CPU
has SHA instructions), and 2.0 GB/s for a direct write to the disk, so SHA-256 alone would cost
more than the write. It finds a damaged file as surely; neither would stop a forger, who can
rewrite the table beside the files. Each entry names its algorithm by its key (``crc32``;
``sha256`` in checkpoints saved before), and a reader verifies either. A resume verifies them,
each rank a share of the files, the shards' as it reads them (verified_read.py); an export
verifies them all before it reads a tensor. A flipped byte so ends in one line naming
the file instead of a wrong weight.

The table is the whole checkpoint: a reader refuses one without it (a tool that rewrote
``distlm.json``, a hand edit; checkpoints written before checksums were recorded lack it
too) and any file the table does not list, so that nothing but ``--no-verify-checkpoint``
reads a checkpoint other than the one its save wrote. A file added after the save is
refused rather than left out with a warning: it was put there to be read (transformers
reads an ``added_tokens.json`` beside the tokenizer), so leaving it out would change the
model exported without anyone deciding that, and taking it in would read what no save
wrote; the user who wants it passes ``--no-verify-checkpoint``.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import threading
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from distlm.checkpoint import directory
from distlm.errors import UsageError

FILES_KEY = "files"
CHECKSUM = "crc32"
"""The algorithm a save records; each entry's key names it."""


class _Crc32:
    """zlib's CRC-32 behind hashlib's interface (``update``, ``hexdigest``)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


ALGORITHMS = {"crc32": _Crc32, "sha256": hashlib.sha256}
"""Checksum name (an entry's key) -> a new hasher; ``sha256`` verifies older checkpoints."""


def digest(path: Path, algorithm: str = CHECKSUM) -> dict[str, Any]:
    """Size and checksum of one file, streamed through one small buffer (a save's peak memory stays put)."""
    with open(path, "rb") as f:
        hasher = hashlib.file_digest(f, ALGORITHMS[algorithm])
        return {"size": f.tell(), algorithm: hasher.hexdigest()}


def written_by(staged: Path, rank: int) -> list[str]:
    """The files of a staged checkpoint that ``rank`` wrote: its shards (DCP names them
    ``__<rank>_<n>.distcp``); rank 0 also every other file but distlm.json."""
    names = []
    for path in sorted(staged.rglob("*")):
        if not path.is_file():
            continue
        name = str(path.relative_to(staged))
        if name.startswith(f"__{rank}_") or (rank == 0 and not name.startswith("__") and name != directory.META_FILE):
            names.append(name)
    return names


def digests(staged: Path, names: list[str],
            hashed: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Size and checksum of each of ``names``: from ``hashed`` (computed while they were
    written) where it has them, else read back (files a save copies in, such as the tokenizer's)."""
    hashed = hashed or {}
    return {name: hashed[name] if name in hashed else digest(staged / name) for name in names}


class _HashingFile(io.RawIOBase):
    """A file opened for writing whose checksum and size follow each write. It cannot seek,
    so the checksum is of the bytes in the order they lie in the file."""

    def __init__(self, raw: io.BufferedWriter):
        super().__init__()
        self._raw = raw
        self.hasher = ALGORITHMS[CHECKSUM]()
        self.size = 0

    @property
    def name(self) -> str:
        return self._raw.name

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        if written != len(view):  # a buffered file writes everything or raises
            raise OSError(f"{self._raw.name}: wrote {written} of {len(view)} bytes")
        self.hasher.update(view)
        self.size += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes the file first
            self._raw.close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every file it writes; ``written`` maps each path to
    its size and checksum once the file is closed (a rename carries its entry along)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[Path, dict[str, Any]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as raw, _HashingFile(raw) as stream:
            yield stream  # DCP closes it itself after its fsync
            self.written[Path(path)] = {"size": stream.size, CHECKSUM: stream.hasher.hexdigest()}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if Path(path) in self.written:
            self.written[Path(new_path)] = self.written.pop(Path(path))


class _ZipChecksums:
    """Switches off torch.save's CRC-32 of each record while any save of distlm's writes.

    DCP writes every tensor with torch.save, whose zip records carry a CRC-32 that
    torch.load never checks; distlm's own CRC-32 of each whole file covers the same bytes.
    Computing both hashed every byte twice, the zip's the slower of the two (miniz's table
    against zlib's). The setting is torch's, for the whole process: a count of the saves
    writing keeps it off until the last one ends, then puts back what it was.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writing = 0
        self._before = True

    @contextmanager
    def off(self) -> Iterator[None]:
        with self._lock:
            if self._writing == 0:
                self._before = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            self._writing += 1
        try:
            yield
        finally:
            with self._lock:
                self._writing -= 1
                if self._writing == 0:
                    torch.serialization.set_crc32_options(self._before)


zip_checksums_off = _ZipChecksums().off


class HashingWriter(FileSystemWriter):
    """DCP's file writer that hashes each file as it writes it (``hashed()``), so that a
    save need not read its shards back to record their checksums."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        with zip_checksums_off():  # the files' own checksums cover every byte once
            return super().write_data(plan, planner)

    def hashed(self) -> dict[str, dict[str, Any]]:
        """Name inside the checkpoint -> size and checksum of each file this writer wrote there."""
        root = Path(self.path)
        return {str(path.relative_to(root)): entry for path, entry in self.fs.written.items()
                if path.is_relative_to(root)}


def verify(path: Path, recorded: dict[str, dict[str, Any]], names: list[str] | None = None,
           contents: bool = True) -> str | None:
    """Why one of the files ``names`` (default: all recorded) differs from what the save
    recorded, or None. Sizes are compared first, so a cut file is found without reading it;
    ``contents=False`` stops there (a load verifies the checksums of the shards as it reads them)."""
    names = sorted(recorded) if names is None else names
    for name in names:
        file = path / name
        expected = recorded[name]
        try:
            status = os.lstat(file)
        except OSError:
            return f"{file} is missing"
        if not stat.S_ISREG(status.st_mode):  # a link to /dev/zero or a FIFO would never finish hashing
            return f"{file} is not a regular file, and a save writes only regular files"
        size = status.st_size
        if size != expected.get("size"):
            return f"{file} has {size} bytes, {expected.get('size')} were written"
        algorithm = algorithm_of(expected)
        if algorithm is None:
            return unknown_checksum(file)
        if contents and digest(file, algorithm)[algorithm] != expected[algorithm]:
            return differs(file, algorithm)
    return None


def algorithm_of(entry: dict[str, Any]) -> str | None:
    """The checksum a table entry records (its key), of those distlm knows."""
    return next((name for name in ALGORITHMS if name in entry), None)


def unknown_checksum(file: Path) -> str:
    return f"{file} has no checksum distlm knows in {directory.META_FILE} (it reads {', '.join(ALGORITHMS)})"


def differs(file: Path, algorithm: str) -> str:
    return f"{file} differs from what was written (its {algorithm} does not match {directory.META_FILE})"


def recorded_files(meta: dict[str, Any], where: Path) -> dict[str, dict[str, Any]]:
    """The checksums a checkpoint recorded, checked to be names inside it; a UsageError if it recorded none."""
    files = meta.get(FILES_KEY)
    if files is None or files == {}:
        raise UsageError(
            f"{where / directory.META_FILE}: {FILES_KEY!r} is {'missing' if files is None else 'empty'}, so its files "
            "cannot be verified: distlm.json was rewritten or edited after the save, or written before checksums "
            "were recorded; restore it from a copy, or pass --no-verify-checkpoint to read the checkpoint unverified")
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and isinstance(entry, dict) and ".." not in Path(name).parts
            and not Path(name).is_absolute() for name, entry in files.items()):
        raise UsageError(f"{where / directory.META_FILE}: {FILES_KEY!r} is not a table of files; the checkpoint is damaged")
    return files


def unlisted(path: Path, recorded: dict[str, dict[str, Any]]) -> str | None:
    """Why ``path`` holds a file its save did not write (one the table does not list), or None."""
    for root, dirs, files in os.walk(path):
        # A link to a directory is not walked into: it is an entry of its own, and no save writes one.
        entries = sorted(files + [name for name in dirs if os.path.islink(os.path.join(root, name))])
        dirs.sort()
        for name in entries:
            relative = os.path.relpath(os.path.join(root, name), path)
            if relative != directory.META_FILE and relative not in recorded:
                return (f"{path / relative} is not among the files its save wrote ({directory.META_FILE} does not "
                        "list it): it was added after the save, and would be read as part of the checkpoint; "
                        "remove it, or pass --no-verify-checkpoint to read the checkpoint as it is")
    return None


def remedy(path: Path, meta: dict[str, Any], exporting: bool = False) -> str:
    """What to do about a damaged checkpoint: the newest older one beside it, as the flag that names it."""
    older = directory.older_checkpoints(path.parent, meta["progress"]["num_updates"])
    if not older:
        return "no older checkpoint is beside it: restore the file from a copy"
    named = f"--checkpoint {path.parent / older[0]}" if exporting else f"--restore-file {older[0]}"
    return f"the file is damaged; use an older checkpoint: {named}"


def identity(path: Path) -> tuple[int, int] | None:
    """What a checkpoint directory is on disk: a save that replaces it renames a new directory into its place."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino
