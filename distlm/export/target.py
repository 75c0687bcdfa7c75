"""Where an export lands: only what distlm wrote, only over a previous export, all at once.

An export directory is written whole into a hidden sibling and then exchanged with the
target in one rename, so a killed export leaves the previous export (or nothing) where
users and serving stacks load from, never a half-written model. A target that holds
anything but an earlier distlm export is someone else's and is refused unless
``--overwrite`` says otherwise. Files carried over from the checkpoint (the tokenizer)
are copied only when they are regular files inside it: a checkpoint is untrusted input,
and a link in it must not copy a file of this machine into a model that is then shared.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any, Iterator

from distlm.checkpoint.directory import fsync_dir, fsync_tree
from distlm.checkpoint.lock import process_exists
from distlm.errors import UsageError

logger = logging.getLogger("distlm")

MARKER = "distlm_export.json"
"""Written into every export directory: what it was exported from."""

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def check_directory_target(out: Path, flag: str, overwrite: bool) -> None:
    """Refuse ``out`` unless it is absent, empty, an earlier distlm export, or ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {out} is a file; name a directory")
    if not out.is_dir() or overwrite or (out / MARKER).is_file():
        return
    try:
        found = sorted(entry.name for entry in os.scandir(out))
    except OSError as err:
        raise UsageError(f"{flag} {out} cannot be read ({err.strerror})") from None
    if found:
        raise UsageError(f"{flag} {out} holds files that are not a distlm export (e.g. {found[0]}); name a new "
                         "or empty directory, or pass --overwrite to replace the directory and all it holds")


def check_file_target(out: Path, flag: str, overwrite: bool) -> None:
    """Refuse to replace an existing file that is not a safetensors file of distlm's, unless ``overwrite``."""
    if out.is_dir():
        raise UsageError(f"{flag} {out} is a directory; name the .safetensors file to write")
    if not out.exists() or overwrite or _safetensors_format(out) == "distlm":
        return
    raise UsageError(f"{flag} {out} exists and is not a distlm export; name a new file, "
                     "or pass --overwrite to replace it")


def _safetensors_format(path: Path) -> Any:
    """The ``format`` entry of a safetensors file's metadata; None for anything else."""
    try:
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            if not 2 <= length <= 100 << 20:
                return None
            return json.loads(file.read(length)).get("__metadata__", {}).get("format")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def staged_directory(out: Path, flag: str, source: dict[str, Any]) -> Iterator[Path]:
    """Yield an empty hidden directory beside ``out``; when the block completes, it becomes
    ``out`` (with the marker describing ``source``) in one exchange, and the previous
    ``out`` is removed. On failure or a kill, ``out`` is as it was."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_stages(out)
        stage = _new_stage(out)
    except OSError as err:
        raise UsageError(f"{flag} {out}: cannot write there ({err.strerror or err})") from None
    try:
        yield stage
        (stage / MARKER).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")
        fsync_tree(stage)  # the exchange must never expose unwritten data
        _replace_directory(stage, out)
        fsync_dir(out.parent)
    except OSError as err:
        raise UsageError(f"{flag} {out}: cannot write ({err.strerror or err})") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # after the exchange: the previous export


def _new_stage(out: Path) -> Path:
    """A new empty directory ``.<out>.<pid>.<random>.partial`` beside ``out``, made with the
    mode the umask gives, which the export keeps when it becomes ``out`` (tempfile.mkdtemp's
    0700 would keep teammates out of every export)."""
    while True:
        stage = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
        try:
            stage.mkdir()
            return stage
        except FileExistsError:
            continue


def _remove_abandoned_stages(out: Path) -> None:
    """Stages of killed exports to ``out``: their process (named in the stage) is gone."""
    for stage in out.parent.glob(f".{out.name}.*.partial"):
        pid = stage.name[len(out.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not process_exists(int(pid)):
            shutil.rmtree(stage, ignore_errors=True)


def _replace_directory(stage: Path, out: Path) -> None:
    """Put ``stage`` at ``out``. Where ``out`` exists, Linux exchanges the two in one step
    (renameat2 with RENAME_EXCHANGE) and ``stage`` then holds the previous ``out``; where
    the filesystem cannot, two renames leave ``out`` absent for a moment in between."""
    if not out.exists():
        os.rename(stage, out)
        return
    if _exchange(stage, out):
        return
    previous = stage.with_name(stage.name + ".previous")
    os.rename(out, previous)
    os.rename(stage, out)
    os.rename(previous, stage)


def _exchange(a: Path, b: Path) -> bool:
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def copy_regular_files(source: Path, target: Path, inside: Path) -> list[Path]:
    """Copy the regular files directly in ``source`` into ``target``; returns the copies.

    Links, directories, devices and a ``source`` that is itself a link or leads outside
    ``inside`` are left out, each named in a warning.
    """
    if source.is_symlink() or not source.resolve().is_relative_to(inside.resolve()):
        logger.warning("%s: left out, it leads outside the checkpoint %s", source, inside)
        return []
    copied, left_out = [], []
    for entry in sorted(os.scandir(source), key=lambda entry: entry.name):
        if not entry.is_file(follow_symlinks=False):
            left_out.append(entry.name)
            continue
        # O_NOFOLLOW and fstat: the file checked is the file read, even if it is swapped meanwhile.
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # replaced by a link since it was listed
            left_out.append(entry.name)
            continue
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                left_out.append(entry.name)
                continue
            with open(target / entry.name, "wb") as copy:
                shutil.copyfileobj(file, copy)
        copied.append(target / entry.name)
    if left_out:
        logger.warning("%s: left out %s (only regular files inside the checkpoint are exported)",
                       source, ", ".join(left_out))
    return copied
