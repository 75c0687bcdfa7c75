"""``Checkpointer``: resume discovery, sharded save and load, RNG, retention and async saves.

Every rank writes its own shards with torch.distributed.checkpoint and reads only the
slices its shards need, so no rank ever holds the whole model or optimizer, and a
checkpoint written under one (strategy, dp, tp) layout resumes under any other. Rank 0
writes ``distlm.json`` beside the shards: what the checkpoint is (arch, task,
dictionary, config) and where training stood (updates, consumed samples, loss scaler,
best validation). See directory.py for how a checkpoint appears atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from distlm.checkpoint import directory, legacy
from distlm.checkpoint.state import (
    capture_rng,
    load_full_optimizer_state,
    load_model_state,
    model_state,
    optimizer_state,
    optimizer_state_to_load,
    restore_rng,
)
from distlm.config import CheckpointConfig
from distlm.distributed import DistContext
from distlm.errors import UsageError
from distlm.parallel.full_state import load_full_state_dict

logger = logging.getLogger("distlm")

FORMAT_VERSION = 2


class CheckpointError(RuntimeError):
    """Saving failed (disk full, a peer lost); the message names the path, and the previous checkpoint is intact."""


@dataclass
class TrainProgress:
    """Where training stands; saved in every checkpoint."""

    num_updates: int = 0
    consumed_samples: int = 0
    best: float | None = None
    """Best validation value so far (``--best-checkpoint-metric``)."""
    validations_without_improvement: int = 0
    lr_schedule_start: int = 0
    """Update at which the learning-rate schedule (re)started (``--reset-lr-scheduler``)."""
    train_wall: float = 0.0


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


class Checkpointer:
    def __init__(self, settings: CheckpointConfig, ctx: DistContext, arch: str, task: str):
        self.settings = settings
        self.ctx = ctx
        self.arch, self.task = arch, task
        self.save_dir = Path(settings.save_dir)
        self._pending: tuple[Future, list[str], dict[str, Any]] | None = None
        self._async_group = None

    @property
    def enabled(self) -> bool:
        return not self.settings.no_save

    # ------------------------------------------------------------------ start

    def prepare(self) -> None:
        """Check the save dir before training and clean up after a killed save (collective)."""
        if not self.enabled:
            return
        problems = self.ctx.all_gather_object(_unusable_save_dir(self.save_dir))
        if problems[self.ctx.rank] is not None:
            raise UsageError(problems[self.ctx.rank])
        refused = [rank for rank, problem in enumerate(problems) if problem is not None]
        if refused:
            raise UsageError(f"--save-dir {self.save_dir} is not usable on ranks {refused} (their errors say why)")
        if self.ctx.is_main:
            for action in directory.recover(self.save_dir):
                logger.info("--save-dir %s: %s", self.save_dir, action)
        if self.settings.async_save and self.ctx.is_distributed:
            # Background saves run their collectives on a group of their own, so they never
            # interleave with the training loop's collectives on the default group.
            self._async_group = dist.new_group(backend="gloo")

    def find_resume(self) -> Resume | None:
        """The checkpoint to resume from, the same on every rank, or None (collective)."""
        settings = self.settings
        explicit = settings.restore_file not in (directory.LAST, "checkpoint_last.pt")
        if settings.no_save and not explicit:
            return None  # --no-save: neither save nor resume, unless a checkpoint is named
        path = self._restore_path()
        found = path is not None and (legacy.is_legacy(path) or directory.is_complete(path))
        seen = self.ctx.all_gather_object(found)
        if len(set(seen)) > 1:
            sees = [rank for rank, ok in enumerate(seen) if ok]
            name = path.name if path is not None else settings.restore_file
            raise UsageError(
                f"--save-dir {self.save_dir}: {name} is there on ranks {sees} only; "
                "put --save-dir on a file system that every rank shares"
            )
        if not found:
            if explicit:
                raise UsageError(f"--restore-file {settings.restore_file}: no checkpoint there ({path})")
            if settings.finetune_from_model:
                return self._finetune_source()
            return None
        meta = legacy.read_meta(path) if legacy.is_legacy(path) else _read_meta(path)
        if meta.get("arch") != self.arch or meta.get("task") != self.task:
            raise UsageError(
                f"{path} is a checkpoint of --arch {meta.get('arch')} --task {meta.get('task')}, not --arch "
                f"{self.arch} --task {self.task}; use another --save-dir (the existing checkpoint is left untouched)"
            )
        return Resume(path, meta)

    def _restore_path(self) -> Path | None:
        name = self.settings.restore_file
        if name in (directory.LAST, "checkpoint_last.pt"):
            for candidate in (self.save_dir / directory.LAST, self.save_dir / directory.LEGACY_LAST_FILE):
                if candidate.exists():
                    return candidate
            return None
        path = Path(name)
        return path if path.is_absolute() or path.exists() else self.save_dir / name

    def _finetune_source(self) -> Resume:
        path = Path(self.settings.finetune_from_model)
        if not (legacy.is_legacy(path) or directory.is_complete(path)):
            raise UsageError(f"--finetune-from-model {path}: not a distlm checkpoint")
        meta = legacy.read_meta(path) if legacy.is_legacy(path) else _read_meta(path)
        return Resume(path, meta, weights_only=True)

    # ------------------------------------------------------------------- load

    def load(self, resume: Resume, model: nn.Module, optimizer: torch.optim.Optimizer, scaler, seed: int) -> TrainProgress:
        """Load ``resume`` into this rank's shards (collective); returns where training stands."""
        settings = self.settings
        meta = resume.meta
        weights_only = resume.weights_only
        load_optimizer = not (weights_only or settings.reset_optimizer)
        if legacy.is_legacy(resume.path):
            state = legacy.read(resume.path)
            load_full_state_dict(model, state["model"])
            if load_optimizer:
                load_full_optimizer_state(model, optimizer, state["optimizer"]["state"])
            rng = state["rng"][self.ctx.rank] if len(state["rng"]) == self.ctx.world_size else None
        else:
            rng = self._load_sharded(resume.path, model, optimizer, load_optimizer)
        progress = TrainProgress(**meta["progress"]) if not weights_only else TrainProgress()
        if not load_optimizer:
            progress = TrainProgress(consumed_samples=progress.consumed_samples, best=progress.best)
        elif scaler is not None and meta.get("scaler") is not None:
            scaler.load_state_dict(meta["scaler"])
        if settings.reset_lr_scheduler:
            progress.lr_schedule_start = progress.num_updates
        if settings.reset_dataloader:
            progress.consumed_samples = 0
        if settings.reset_meters:
            progress.train_wall = 0.0
        same_layout = meta.get("world_size") == self.ctx.world_size and meta.get("layout") == self.ctx.layout
        if rng is not None and same_layout and not weights_only:
            restore_rng(rng)
        else:
            # A rank's saved stream belongs to its old place in the layout: restored on a new
            # one, two tp ranks of one replica could draw different dropout masks (and two
            # replicas the same). Reseed by data-parallel rank, as a fresh run seeds.
            torch.manual_seed(seed * 1000 + self.ctx.dp_rank + 7919 * progress.num_updates)
            if not weights_only:
                logger.info(
                    "layout changed (world %s, %s -> world %d, %s): dropout RNG reseeded by data-parallel rank",
                    meta.get("world_size"), meta.get("layout"), self.ctx.world_size, self.ctx.layout,
                )
        what = "weights of" if weights_only else "resumed from"
        logger.info("%s %s at update %d (%d samples consumed)", what, resume.path, progress.num_updates,
                    progress.consumed_samples)
        return progress

    def _load_sharded(self, path: Path, model: nn.Module, optimizer, load_optimizer: bool) -> dict | None:
        saved = dcp.FileSystemReader(str(path)).read_metadata()
        _check_shards_present(path, saved)
        keys = set(saved.state_dict_metadata)
        state: dict[str, Any] = {"model": model_state(model)}
        missing = [f"model.{name}" for name in state["model"] if f"model.{name}" not in keys]
        if missing:
            raise UsageError(f"{path} holds no {missing[0]}; it is a checkpoint of another model")
        if load_optimizer:
            state["optimizer"] = optimizer_state_to_load(model, optimizer, keys)
        rng_key = f"rank{self.ctx.rank}"
        if f"rng.{rng_key}.cpu" in keys:
            state["rng"] = {rng_key: {name: tensor for name, tensor in capture_rng().items()
                                      if f"rng.{rng_key}.{name}" in keys}}
        try:
            with _single_process_quiet():
                dcp.load(state, checkpoint_id=str(path), no_dist=not self.ctx.is_distributed)
        except dcp.CheckpointException as err:
            raise UsageError(f"{path}: cannot be read ({_first_line(err)})") from None
        load_model_state(model, state["model"])
        return state.get("rng", {}).get(rng_key)

    # ------------------------------------------------------------------- save

    def due(self, num_updates: int, end_of_epoch: int | None, done: bool) -> list[str]:
        """Names to save now, after an *applied* update (``end_of_epoch``: the epoch that just ended)."""
        if not self.enabled:
            return []
        settings = self.settings
        names = []
        interval = settings.save_interval_updates
        if interval and num_updates % interval == 0:
            names.append(directory.numbered(num_updates))
        if end_of_epoch is not None and not settings.no_epoch_checkpoints and end_of_epoch % settings.save_interval == 0:
            names.append(directory.epoch_name(end_of_epoch))
        if (names or done or end_of_epoch is not None) and not settings.no_last_checkpoints:
            names.append(directory.LAST)
        return names

    def save(
        self,
        names: list[str],
        progress: TrainProgress,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler,
        describe: dict[str, Any],
        write_extras: Callable[[Path], None] | None = None,
    ) -> None:
        """Write one checkpoint under ``names`` (collective). ``describe`` adds to distlm.json
        (dictionary, config); rank 0 calls ``write_extras(directory)`` to add small files
        (the tokenizer). The next save, or ``wait()``, completes an asynchronous one."""
        if not names or not self.enabled:
            return
        self.wait()
        first = names[0]
        staged = directory.incomplete(self.save_dir, first)
        if self.ctx.is_main:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
            if write_extras is not None:
                write_extras(staged)
        self.ctx.barrier()
        state = {
            "model": model_state(model),
            "optimizer": optimizer_state(model, optimizer),
            "rng": {f"rank{self.ctx.rank}": capture_rng()},
        }
        meta = {
            "format": FORMAT_VERSION,
            "arch": self.arch,
            "task": self.task,
            "world_size": self.ctx.world_size,
            "layout": self.ctx.layout,
            "progress": dataclasses.asdict(progress),
            "scaler": scaler.state_dict() if scaler is not None else None,
            **describe,
        }
        started = time.perf_counter()
        try:
            if self.settings.async_save:
                with _single_process_quiet():
                    future = dcp.async_save(state, checkpoint_id=str(staged), process_group=self._async_group,
                                            no_dist=not self.ctx.is_distributed)
                self._pending = (future, names, meta)
                logger.info("checkpoint %s: staged in %.2f s, writing in the background", first,
                            time.perf_counter() - started)
                return
            with _single_process_quiet():
                dcp.save(state, checkpoint_id=str(staged), no_dist=not self.ctx.is_distributed)
        except (dcp.CheckpointException, OSError) as err:
            self._abandon(staged, err)
        self._commit(names, meta)
        logger.info("saved %s in %.2f s", ", ".join(names), time.perf_counter() - started)

    def wait(self) -> None:
        """Complete an asynchronous save still being written (collective)."""
        if self._pending is None:
            return
        future, names, meta = self._pending
        self._pending = None
        try:
            future.result()
        except (dcp.CheckpointException, OSError) as err:
            self._abandon(directory.incomplete(self.save_dir, names[0]), err)
        self._commit(names, meta)
        logger.info("saved %s (written in the background)", ", ".join(names))

    def _commit(self, names: list[str], meta: dict[str, Any]) -> None:
        self.ctx.barrier()  # every rank's shards are written
        failure = None
        if self.ctx.is_main:
            try:
                staged = directory.incomplete(self.save_dir, names[0])
                _write_json(staged / directory.META_FILE, meta)
                final = directory.commit(self.save_dir, names[0])
                for name in names[1:]:
                    directory.link_copy(final, self.save_dir, name)
                    directory.commit(self.save_dir, name)
                for name in directory.retain(
                    self.save_dir, self.settings.keep_interval_updates, self.settings.keep_last_epochs
                ):
                    logger.info("deleted %s (--keep-interval-updates/--keep-last-epochs)", name)
            except OSError as err:
                failure = f"{err.strerror or err}"
        failure = self.ctx.all_gather_object(failure)[0]
        if failure is not None:
            raise CheckpointError(
                f"saving {', '.join(names)} in {self.save_dir} failed: {failure}; the previous checkpoint is intact"
            )

    def _abandon(self, staged: Path, err: BaseException) -> None:
        if self.ctx.is_main:
            shutil.rmtree(staged, ignore_errors=True)
        raise CheckpointError(
            f"saving a checkpoint in {self.save_dir} failed: {_first_line(err)}; the previous checkpoint is intact"
        ) from None


def _unusable_save_dir(save_dir: Path) -> str | None:
    if save_dir.exists() and not save_dir.is_dir():
        return f"--save-dir {save_dir} is a file; name a directory"
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"--save-dir {save_dir} cannot be created ({err.strerror or err}); name a writable directory"
    if not os.access(save_dir, os.W_OK | os.X_OK):
        return f"--save-dir {save_dir} is not writable; fix its permissions or name another directory"
    return None


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / directory.META_FILE).read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"{path / directory.META_FILE}: not readable ({err}); the checkpoint is damaged") from None
    if meta.get("format") != FORMAT_VERSION:
        raise UsageError(f"{path}: checkpoint format {meta.get('format')}, this distlm reads {FORMAT_VERSION}")
    for key in ("arch", "task", "progress", "world_size", "layout"):
        if key not in meta:
            raise UsageError(f"{path / directory.META_FILE} holds no {key!r}; the checkpoint is damaged")
    return meta


def _check_shards_present(path: Path, metadata) -> None:
    files = {info.relative_path for info in metadata.storage_data.values()}
    missing = sorted(name for name in files if not (path / name).is_file())
    if missing:
        raise UsageError(f"{path} lacks shard {missing[0]} (of {len(files)}); the checkpoint is incomplete")


def _write_json(path: Path, value: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes a single process when no process group exists; that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    for line in text.splitlines():
        if "Error" in line and ":" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(err).__name__
