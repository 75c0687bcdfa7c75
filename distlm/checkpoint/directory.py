"""Checkpoint directories in a save dir: their names, atomic commit, recovery and retention.

A checkpoint is a directory that every rank writes its shards into. It becomes visible
under its final name only when every rank's shards and the metadata are on disk: the
shards go to ``.incomplete-<name>``, files and directories are fsynced, and one rename
puts it in place. Replacing an existing checkpoint takes two renames (the old one
steps aside as ``.replaced-<name>``, the new one moves in); a run killed between them
leaves both, and ``recover`` puts the right one back when the next run starts.

Names follow fairseq: ``checkpoint_last``, ``checkpoint_best``, ``checkpoint<epoch>`` at
the end of an epoch and ``checkpoint_<updates>`` every ``--save-interval-updates``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

LAST = "checkpoint_last"
BEST = "checkpoint_best"
META_FILE = "distlm.json"
TOKENIZER_DIR = "tokenizer"
DCP_METADATA_FILE = ".metadata"
LEGACY_LAST_FILE = "checkpoint_last.pt"
_INCOMPLETE = ".incomplete-"
_REPLACED = ".replaced-"
_UPDATE_NAME = re.compile(r"checkpoint_(\d+)")
_EPOCH_NAME = re.compile(r"checkpoint(\d+)")


def numbered(update: int) -> str:
    """Name of the checkpoint saved every ``--save-interval-updates``."""
    return f"checkpoint_{update}"


def epoch_name(epoch: int) -> str:
    """Name of the checkpoint saved at the end of ``epoch`` (1-based), as fairseq names it."""
    return f"checkpoint{epoch}"


def incomplete(save_dir: Path, name: str) -> Path:
    return save_dir / f"{_INCOMPLETE}{name}"


def is_complete(path: Path) -> bool:
    """A committed checkpoint directory: both metadata files are there."""
    return (path / META_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the directories, so a rename publishes data on disk."""
    for entry in path.iterdir():
        if entry.is_dir():
            fsync_tree(entry)
        elif entry.is_file():
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(save_dir: Path, name: str) -> Path:
    """Move ``.incomplete-<name>`` into place as ``name`` (rank 0 only, after every rank wrote)."""
    staged, final = incomplete(save_dir, name), save_dir / name
    fsync_tree(staged)
    if final.exists() or final.is_symlink():
        replaced = save_dir / f"{_REPLACED}{name}"
        remove(replaced)
        os.rename(final, replaced)
        os.rename(staged, final)
        fsync_dir(save_dir)
        remove(replaced)
    else:
        os.rename(staged, final)
        fsync_dir(save_dir)
    return final


def remove(path: Path) -> None:
    """Remove what a save left at ``path``: a directory with all it holds, or a link (the
    checkpoint name a user pointed at another checkpoint, stepped aside by a save), never
    what a link leads to. shutil.rmtree refuses a link, and ignoring that left it there:
    the next save's rename onto it then failed."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def link_copy(source: Path, save_dir: Path, name: str) -> None:
    """Stage a second name for a checkpoint already written: hard links, no data copied."""
    staged = incomplete(save_dir, name)
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for entry in source.rglob("*"):
        target = staged / entry.relative_to(source)
        if entry.is_dir():
            target.mkdir(exist_ok=True)
            continue
        try:
            os.link(entry, target)
        except OSError:  # a file system without hard links
            shutil.copy2(entry, target)


def recover(save_dir: Path) -> list[str]:
    """Finish or undo what a killed save left behind; returns what was done (rank 0, at start).

    A ``.replaced-<name>`` whose ``<name>`` is missing was stepped aside by a save killed
    between its two renames: it is the last complete checkpoint, so it moves back.
    Everything else staged and never committed is removed.
    """
    done = []
    if not save_dir.is_dir():
        return done
    for entry in sorted(save_dir.iterdir()):
        if entry.name.startswith(_REPLACED):
            final = save_dir / entry.name[len(_REPLACED):]
            if not final.exists() and not final.is_symlink() and is_complete(entry):
                os.rename(entry, final)
                done.append(f"restored {final.name} from an interrupted save")
            else:
                remove(entry)
                done.append(f"removed {entry.name}")
        elif entry.name.startswith(_INCOMPLETE):
            remove(entry)
            done.append(f"removed {entry.name}, left by a save that did not finish")
    if done:
        fsync_dir(save_dir)
    return done


def retain(save_dir: Path, keep_interval_updates: int, keep_last_epochs: int) -> list[str]:
    """Delete all but the newest ``keep_interval_updates`` update checkpoints and the newest
    ``keep_last_epochs`` epoch checkpoints (fairseq's flags; 0 keeps all). Returns the names deleted."""
    deleted = []
    for pattern, keep in ((_UPDATE_NAME, keep_interval_updates), (_EPOCH_NAME, keep_last_epochs)):
        if keep <= 0 or not save_dir.is_dir():
            continue
        found = sorted(
            (int(match.group(1)), entry)
            for entry in save_dir.iterdir()
            if (match := pattern.fullmatch(entry.name)) and entry.is_dir()
        )
        for _, entry in found[:-keep]:
            shutil.rmtree(entry, ignore_errors=True)
            deleted.append(entry.name)
    return deleted


def older_checkpoints(save_dir: Path, update: int) -> list[str]:
    """Names of the committed checkpoints in ``save_dir`` from before ``update``, newest first.

    Saved at another update, so none shares a file with the checkpoint at ``update``
    (its second names are hard links).
    """
    found = []
    for entry in save_dir.iterdir() if save_dir.is_dir() else ():
        if entry.name.startswith("checkpoint") and entry.is_dir() and is_complete(entry):
            try:
                saved = json.loads((entry / META_FILE).read_text())["progress"]["num_updates"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if isinstance(saved, int) and saved < update:
                found.append((saved, entry.name))
    return [name for _, name in sorted(found, reverse=True)]
