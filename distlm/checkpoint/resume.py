"""Which checkpoint a run resumes from: ``--restore-file`` (by default the save dir's
``checkpoint_last``, or the single-file ``checkpoint_last.pt`` of older versions), else the
weights of ``--finetune-from-model``, else none.

Every rank looks for itself and all must see the same: a checkpoint visible on some ranks
only means a save dir that is not shared, and a checkpoint directory that lacks a metadata
file is damaged (a save commits only complete ones), refused rather than taken for "no
checkpoint" and overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distlm.checkpoint import directory, legacy
from distlm.checkpoint import meta as meta_file
from distlm.config import CheckpointConfig
from distlm.errors import UsageError
from distlm.runtime.context import DistContext


@dataclass(frozen=True)
class Resume:
    """A checkpoint to resume from, found and checked on every rank."""

    path: Path
    meta: dict[str, Any]
    weights_only: bool = False
    """``--finetune-from-model``: take the weights, start everything else afresh."""

    @property
    def dictionary(self) -> list[str] | None:
        return self.meta.get("dictionary")


def find_resume(settings: CheckpointConfig, ctx: DistContext, arch: str, task: str) -> Resume | None:
    """The checkpoint to resume from, the same on every rank, or None (collective)."""
    save_dir = Path(settings.save_dir)
    explicit = not names_last(settings.restore_file)
    if settings.no_save and not explicit:
        return None  # --no-save: neither save nor resume, unless a checkpoint is named
    path = _restore_path(settings.restore_file, save_dir)
    # A directory under a checkpoint's name that lacks a metadata file is damaged (commit
    # renames only complete ones): refused, never taken for "no checkpoint" and overwritten.
    damage = _incomplete(path) if path is not None and path.is_dir() else None
    found = path is not None and (legacy.is_legacy(path) or directory.is_complete(path))
    seen = ctx.all_gather_object((found, damage))
    if len({ok for ok, _ in seen}) > 1:
        sees = [rank for rank, (ok, _) in enumerate(seen) if ok]
        name = path.name if path is not None else settings.restore_file
        raise UsageError(
            f"--save-dir {save_dir}: {name} is there on ranks {sees} only; "
            "put --save-dir on a file system that every rank shares"
        )
    damaged = [problem for _, problem in seen if problem is not None]
    if damaged:
        raise UsageError(damaged[0])
    if not found:
        if explicit:
            raise UsageError(f"--restore-file {settings.restore_file}: no checkpoint there ({path})")
        if settings.finetune_from_model:
            return _finetune_source(Path(settings.finetune_from_model), ctx)
        return None
    meta = _read_meta(path)
    if meta.get("arch") != arch or meta.get("task") != task:
        raise UsageError(
            f"{path} is a checkpoint of --arch {meta.get('arch')} --task {meta.get('task')}, not --arch "
            f"{arch} --task {task}; use another --save-dir (the existing checkpoint is left untouched)"
        )
    return Resume(path, meta)


def names_last(restore_file: str) -> bool:
    """``--restore-file`` names the save dir's newest checkpoint, in either format, not a chosen one."""
    return restore_file in (directory.LAST, directory.LEGACY_LAST_FILE)


def _restore_path(name: str, save_dir: Path) -> Path | None:
    if names_last(name):
        for candidate in (save_dir / directory.LAST, save_dir / directory.LEGACY_LAST_FILE):
            if candidate.exists():
                return candidate
        return None
    path = Path(name)
    return path if path.is_absolute() or path.exists() else save_dir / name


def _finetune_source(path: Path, ctx: DistContext) -> Resume:
    """The checkpoint of --finetune-from-model, the same on every rank (collective)."""
    seen = ctx.all_gather_object(legacy.is_legacy(path) or directory.is_complete(path))
    if not all(seen):
        missing = [rank for rank, ok in enumerate(seen) if not ok]
        raise UsageError(f"--finetune-from-model {path}: not a distlm checkpoint on ranks {missing}; "
                         "name a checkpoint directory every rank can read")
    return Resume(path, _read_meta(path), weights_only=True)


def _read_meta(path: Path) -> dict[str, Any]:
    """The checked description of a checkpoint of either format."""
    return legacy.read_meta(path) if legacy.is_legacy(path) else meta_file.read(path)


def _incomplete(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be read (a metadata file missing), or None."""
    for name in (directory.META_FILE, directory.DCP_METADATA_FILE):
        if not (path / name).is_file():
            return f"{path} lacks {name}; the checkpoint is incomplete (remove it, or name another with --restore-file)"
    return None
