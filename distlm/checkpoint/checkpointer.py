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
import errno
import json
import logging
import os
import shutil
import socket
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from distlm.runtime.agreement import data_files
from distlm.checkpoint import compare, directory, integrity, legacy, shared_dir, storage
from distlm.checkpoint import meta as meta_file
from distlm.checkpoint.lock import SaveDirLock
from distlm.checkpoint.stateful import (MODEL, OPTIMIZER, PROGRESS, RNG, SCALER, ModelState, OptimizerState, RNGState,
                                        TrainProgress, load_full_optimizer_state, seed_dropout)
from distlm.config import CheckpointConfig
from distlm.runtime.context import DistContext, describe_layout
from distlm.errors import UsageError
from distlm.state.full import load_full_state_dict

logger = logging.getLogger("distlm")

class CheckpointError(UsageError, RuntimeError):
    """Saving failed (a full disk, a write error); the message names the path, and the previous checkpoint is intact.

    A ``UsageError``, so the command line ends with that one line and exit status 2: what
    fixes it (space, permissions, the file system) is the user's.
    """


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
        self._pending: tuple[Future, list[str], dict[str, Any], integrity.HashingWriter] | None = None
        self._async_group = None
        self._saved_at: int | None = None
        """The update the newest checkpoint (saved or resumed from) holds: saving it again would repeat it."""
        self._lock: SaveDirLock | None = None

    @property
    def enabled(self) -> bool:
        return not self.settings.no_save

    # ------------------------------------------------------------------ start

    def prepare(self) -> None:
        """Check the save dir before training and clean up after a killed save (collective)."""
        if not self.enabled:
            return
        problem = _unusable_save_dir(self.save_dir)
        if problem is None and self.ctx.is_main:
            # The lock first: the clean-up below removes what another run's save is writing.
            try:
                self._lock = SaveDirLock(self.save_dir)
                self._lock.acquire()
            except UsageError as err:
                self._lock, problem = None, str(err)
        if problem is None and self.ctx.is_main:
            # Before the collective below, so no rank looks for checkpoint_last while rank 0
            # may still be moving it back into place.
            try:
                for action in directory.recover(self.save_dir):
                    logger.info("--save-dir %s: %s", self.save_dir, action)
            except OSError as err:
                problem = f"--save-dir {self.save_dir}: cannot clean up after an interrupted save ({_reason(err)})"
        problems = self.ctx.all_gather_object(problem)
        if problems[self.ctx.rank] is not None:
            raise UsageError(problems[self.ctx.rank])
        refused = [rank for rank, problem in enumerate(problems) if problem is not None]
        if refused:
            raise UsageError(f"--save-dir {self.save_dir} is not usable on ranks {refused} (their errors say why)")
        self._check_shared()
        if self.settings.async_save and self.ctx.is_distributed:
            # Background saves run their collectives on a group of their own, so they never
            # interleave with the training loop's collectives on the default group.
            self._async_group = dist.new_group(backend="gloo")

    def _check_shared(self) -> None:
        """Refuse, before the first update, a save dir that is not one file system for every
        rank (collective): its checkpoints would lie in pieces on several disks."""
        if not self.ctx.is_distributed:
            return
        reports = shared_dir.probe_save_dir(self.ctx.rank, self.ctx.world_size, str(self.save_dir),
                                            self.ctx.all_gather_object)
        problem = reports if isinstance(reports, str) else shared_dir.sharing_problem(reports)
        if problem is not None:
            self.close()  # a refused run leaves no lock behind
            raise UsageError(f"--save-dir {problem}")

    def find_resume(self) -> Resume | None:
        """The checkpoint to resume from, the same on every rank, or None (collective)."""
        settings = self.settings
        explicit = settings.restore_file not in (directory.LAST, "checkpoint_last.pt")
        if settings.no_save and not explicit:
            return None  # --no-save: neither save nor resume, unless a checkpoint is named
        path = self._restore_path()
        # A directory under a checkpoint's name that lacks a metadata file is damaged (commit
        # renames only complete ones): refused, never taken for "no checkpoint" and overwritten.
        damage = _incomplete(path) if path is not None and path.is_dir() else None
        found = path is not None and (legacy.is_legacy(path) or directory.is_complete(path))
        seen = self.ctx.all_gather_object((found, damage))
        if len({ok for ok, _ in seen}) > 1:
            sees = [rank for rank, (ok, _) in enumerate(seen) if ok]
            name = path.name if path is not None else settings.restore_file
            raise UsageError(
                f"--save-dir {self.save_dir}: {name} is there on ranks {sees} only; "
                "put --save-dir on a file system that every rank shares"
            )
        damaged = [problem for _, problem in seen if problem is not None]
        if damaged:
            raise UsageError(damaged[0])
        if not found:
            if explicit:
                raise UsageError(f"--restore-file {settings.restore_file}: no checkpoint there ({path})")
            if settings.finetune_from_model:
                return self._finetune_source()
            return None
        meta = legacy.read_meta(path) if legacy.is_legacy(path) else meta_file.read(path)
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
        """The checkpoint of --finetune-from-model, the same on every rank (collective)."""
        path = Path(self.settings.finetune_from_model)
        seen = self.ctx.all_gather_object(legacy.is_legacy(path) or directory.is_complete(path))
        if not all(seen):
            missing = [rank for rank, ok in enumerate(seen) if not ok]
            raise UsageError(f"--finetune-from-model {path}: not a distlm checkpoint on ranks {missing}; "
                             "name a checkpoint directory every rank can read")
        meta = legacy.read_meta(path) if legacy.is_legacy(path) else meta_file.read(path)
        return Resume(path, meta, weights_only=True)

    def close(self) -> None:
        """Give up the save dir (rank 0 removes its lock); the run is over."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def announce_last(self) -> None:
        """Rank 0 says where the last checkpoint is and how to export it."""
        last = self.save_dir / directory.LAST
        if self.ctx.is_main and self.enabled and last.is_dir():
            logger.info("last checkpoint: %s; export it with: python -m distlm.export --checkpoint %s --hf OUT_DIR",
                        last, last)

    # ------------------------------------------------------------------- load

    def load(self, resume: Resume, states: Mapping[str, Stateful], seed: int,
             config: dict[str, Any] | None = None) -> None:
        """Load ``resume`` into ``states`` (collective): the model's shards, and unless only
        the weights are wanted, every other state the checkpoint holds. ``config``, the
        run's settings, is compared with the checkpoint's and the changes logged."""
        settings = self.settings
        meta = resume.meta
        weights_only = resume.weights_only
        load_optimizer = not (weights_only or settings.reset_optimizer)
        same_layout = meta.get("world_size") == self.ctx.world_size and meta.get("layout") == self.ctx.layout
        skipped = {RNG} if not same_layout else set()
        if not load_optimizer:
            skipped |= {OPTIMIZER, SCALER}
        wanted = [MODEL] if weights_only else [key for key in states if key not in skipped]
        if config is not None and not weights_only:
            self._check_data(resume, config)
        if legacy.is_legacy(resume.path):
            loaded = self._load_legacy(resume.path, states, wanted)
        else:
            loaded = self._load_sharded(resume.path, meta, states, wanted, partial=weights_only and settings.load_partial)
        for key in wanted:
            # States kept in distlm.json (the progress, the loss scaler, whatever holds no tensor).
            if key not in loaded and isinstance(meta.get(key), dict):
                states[key].load_state_dict(meta[key])
                loaded.add(key)
        progress: TrainProgress = states[PROGRESS]
        # The reset flags mean what they mean in fairseq. --reset-optimizer also restarts the
        # update count (and with it the schedule); --reset-optimizer and --reset-meters drop
        # the best validation value; --reset-lr-scheduler only skips the scheduler's own
        # state, and distlm's schedules, like fairseq's polynomial_decay, inverse_sqrt and
        # cosine, have none beyond the update count.
        if not load_optimizer:
            progress.load_state_dict({"consumed_samples": progress.consumed_samples})
        if settings.reset_meters:
            progress.best, progress.validations_without_improvement, progress.train_wall = None, 0, 0.0
        if settings.reset_dataloader:
            progress.consumed_samples = 0
        if settings.reset_lr_scheduler and not weights_only and self.ctx.is_main:
            logger.info("--reset-lr-scheduler: the learning rate follows the update count (%d)%s, as in fairseq",
                        progress.num_updates,
                        "" if settings.reset_optimizer else "; add --reset-optimizer to restart the count and the schedule")
        if RNG not in loaded:
            # A rank's saved stream belongs to its old place in the layout: restored on a new
            # one, two tp ranks of one replica could draw different dropout masks (and two
            # replicas the same). Reseed by data-parallel rank, as a fresh run seeds.
            seed_dropout(seed, self.ctx.dp_rank, progress.num_updates)
            if not weights_only:
                logger.info(
                    "layout changed (world %s, %s -> world %d, %s): dropout RNG reseeded by data-parallel rank",
                    meta.get("world_size"), describe_layout(meta.get("layout")), self.ctx.world_size,
                    describe_layout(self.ctx.layout),
                )
        self._saved_at = progress.num_updates
        legacy.read.cache_clear()  # an old single-file checkpoint is read once, not kept for the run
        what = "weights of" if weights_only else "resumed from"
        logger.info("%s %s at update %d (%d samples consumed)", what, resume.path, progress.num_updates,
                    progress.consumed_samples)
        if config is not None and not weights_only and self.ctx.is_main:
            saved_layout = meta.get("layout")
            changes = compare.changed_settings(meta.get("config"), config,
                                               saved_layout.get("dp") if isinstance(saved_layout, dict) else None,
                                               self.ctx.dims.dp, progress.consumed_samples, progress.num_updates)
            if changes:
                logger.info("%s", changes)

    def _check_data(self, resume: Resume, config: dict[str, Any]) -> None:
        """Refuse data replaced under the saved position, unless the data starts afresh (every rank the same)."""
        data = config.get("data", {}).get("data")
        changed = compare.data_difference(resume.meta.get("data_files"), data_files(data))
        if changed is None:
            return
        if not self.settings.reset_dataloader:
            consumed = (resume.meta.get("progress") or {}).get("consumed_samples")
            raise UsageError(f"--data {data}: {changed} since {resume.path} was saved, so its data position "
                             f"({consumed} samples consumed) would read other text; add --reset-dataloader to start "
                             "the data from its beginning, or restore the data the run was trained on")
        if self.ctx.is_main:
            logger.info("--data %s: %s since %s was saved; --reset-dataloader: the data starts from its beginning",
                        data, changed, resume.path)

    def _load_legacy(self, path: Path, states: Mapping[str, Stateful], wanted: list[str]) -> set[str]:
        """The old single-file format: whole tensors cut into this rank's shards."""
        state = legacy.read(path)
        model: ModelState = states[MODEL]
        built = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        difference = compare.first_model_difference({n: tuple(t.shape) for n, t in state["model"].items()}, built)
        if difference is not None:
            raise UsageError(f"{path} is a checkpoint of another model: {difference}; "
                             "build the model it was saved from (its settings are in the checkpoint's config)")
        load_full_state_dict(model.model, state["model"])
        loaded = {MODEL}
        if OPTIMIZER in wanted:
            optimizer: OptimizerState = states[OPTIMIZER]
            load_full_optimizer_state(optimizer.model, optimizer.optimizer, state["optimizer"]["state"])
            loaded.add(OPTIMIZER)
        if RNG in wanted and len(state["rng"]) == self.ctx.world_size:
            rng: RNGState = states[RNG]
            rng.load_state_dict({rng.key: state["rng"][self.ctx.rank]})
            loaded.add(RNG)
        return loaded

    def _load_sharded(self, path: Path, meta: dict[str, Any], states: Mapping[str, Stateful], wanted: list[str],
                      partial: bool) -> set[str]:
        """Load every wanted state the shards hold; returns their names."""
        saved = storage.read_metadata(path)
        storage.check_shards_present(path, saved)
        self._verify(path, meta)
        entries = saved.state_dict_metadata
        prefixes = _prefixes(entries)
        templates: dict[str, Any] = {}
        for key in wanted:
            if key not in prefixes:
                continue  # kept in distlm.json, or not in this checkpoint (a state registered since)
            template = states[key].state_dict()
            if key == MODEL:
                template = self._model_to_load(path, template, entries, partial)
            template = _present(template, key, entries, prefixes, path)
            if template:
                templates[key] = template
        try:
            with _single_process_quiet():
                storage.load(templates, path, no_dist=not self.ctx.is_distributed)
        except dcp.CheckpointException as err:
            raise UsageError(f"{path}: cannot be read ({storage.read_failure(err)})") from None
        for key, state in templates.items():
            states[key].load_state_dict(state)
        return set(templates)

    def _model_to_load(self, path: Path, template: dict[str, Any], entries: dict[str, Any], partial: bool) -> dict:
        """The model's state to read: all of it, refused if the checkpoint's model differs,
        or with --load-partial the weights both share."""
        for key, md in entries.items():
            if key.startswith("model.") and isinstance(md, BytesStorageMetadata):
                storage.refuse_non_tensor(path, key)
        saved = {key.removeprefix("model."): tuple(md.size) for key, md in entries.items()
                 if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
        built = {name: tuple(tensor.shape) for name, tensor in template.items()}
        dims = self.ctx.dims
        if dims.pp_enabled:  # a pipeline rank holds its stages: the model is what the stages hold together
            parts: list[Any] = [None] * dims.pp
            dist.all_gather_object(parts, built, group=dims.pp_group(self.ctx.device.type))
            built = {name: shape for part in parts for name, shape in part.items()}
        difference = compare.first_model_difference(saved, built)
        if difference is None:
            return template
        if not partial:
            hint = ("add --load-partial to load the weights both share" if self.settings.finetune_from_model
                    else "build the model it was saved from (its settings are in the checkpoint's config), "
                         "or start from its weights with --finetune-from-model and --load-partial")
            raise UsageError(f"{path} is a checkpoint of another model: {difference}; {hint}")
        shared, left_out = compare.shared_weights(saved, built)
        if self.ctx.is_main:
            logger.info("--load-partial: %d weights loaded from %s, %d left out: %s", len(shared), path,
                        len(left_out), ", ".join(left_out))
        return {name: template[name] for name in shared if name in template}

    def _verify(self, path: Path, meta: dict[str, Any]) -> None:
        """Every file against the checksums the save recorded, each rank a share, and no file
        there that the save did not write (collective)."""
        if self.settings.no_verify_checkpoint:
            if self.ctx.is_main:
                logger.warning("%s: checksums not verified (--no-verify-checkpoint)", path)
            return
        files = integrity.recorded_files(meta, path)
        names = sorted(files)[self.ctx.rank::self.ctx.world_size]
        problem = integrity.verify(path, files, names)
        if problem is not None:
            problem = f"{problem}; {integrity.remedy(path, meta)}"
        elif self.ctx.is_main:
            problem = integrity.unlisted(path, files)
        problems = [problem for problem in self.ctx.all_gather_object(problem) if problem is not None]
        if problems:
            raise UsageError(problems[0])

    # ------------------------------------------------------------------- save

    def due(self, num_updates: int, end_of_epoch: int | None, done: bool) -> list[str]:
        """Names to save now (``end_of_epoch``: the epoch that just ended, if one did).

        fairseq's rule: a save is due every ``--save-interval-updates`` updates, at the end
        of every ``--save-interval``-th epoch and when training stops. It writes
        ``checkpoint_<updates>`` at an interval inside an epoch, ``checkpoint<epoch>`` at
        the end of a due epoch (unless ``--no-epoch-checkpoints``) and ``checkpoint_last``
        (unless ``--no-last-checkpoints``). Nothing is due while the update count has not
        moved since the newest checkpoint (saved or resumed from): a skipped update (fp16
        overflow, the first update of double buffering) or a run that resumes finished
        would write the same checkpoint again. The one exception is an epoch that ends on
        such an update: its ``checkpoint<epoch>`` is a name not yet written.
        """
        if not self.enabled:
            return []
        settings = self.settings
        epoch_due = end_of_epoch is not None and end_of_epoch % settings.save_interval == 0
        if num_updates == self._saved_at:
            return [directory.epoch_name(end_of_epoch)] if epoch_due and not settings.no_epoch_checkpoints else []
        interval_due = bool(settings.save_interval_updates) and num_updates > 0 and (
            num_updates % settings.save_interval_updates == 0)
        names = []
        if interval_due and end_of_epoch is None:
            names.append(directory.numbered(num_updates))
        if epoch_due and not settings.no_epoch_checkpoints:
            names.append(directory.epoch_name(end_of_epoch))
        if (interval_due or epoch_due or done) and not settings.no_last_checkpoints:
            names.append(directory.LAST)
        return names

    def save(
        self,
        names: list[str],
        states: Mapping[str, Stateful],
        describe: dict[str, Any],
        write_extras: Callable[[Path], None] | None = None,
    ) -> None:
        """Write ``states`` as one checkpoint under ``names`` (collective): every state with
        tensors into the shards under its name, every other into distlm.json. ``describe``
        adds to distlm.json (dictionary, config); rank 0 calls ``write_extras(directory)``
        to add small files (the tokenizer). The next save, or ``wait()``, completes an
        asynchronous one.

        A failed write ends with ``CheckpointError`` on every rank, a peer lost meanwhile
        with ``CollectiveFailure``: one line each, and the previous checkpoint is intact.
        """
        if not names or not self.enabled:
            return
        self.wait()
        with self.ctx.naming_failed_collectives(states[PROGRESS].num_updates):
            self._save(names, states, describe, write_extras)

    def _save(
        self,
        names: list[str],
        states: Mapping[str, Stateful],
        describe: dict[str, Any],
        write_extras: Callable[[Path], None] | None,
    ) -> None:
        first = names[0]
        self._saved_at = states[PROGRESS].num_updates
        staged = directory.incomplete(self.save_dir, first)
        lost = failure = None
        if self.ctx.is_main:
            lost = self._lock_lost()
        if self.ctx.is_main and lost is None:
            try:
                shutil.rmtree(staged, ignore_errors=True)
                staged.mkdir(parents=True)
                if write_extras is not None:
                    write_extras(staged)
            except OSError as err:
                shutil.rmtree(staged, ignore_errors=True)
                failure = _reason(err)
        # Also the barrier before anyone writes into the staged directory.
        lost, failure = self.ctx.all_gather_object((lost, failure))[0]
        if lost is not None:
            raise UsageError(lost)
        if failure is not None:
            raise CheckpointError(
                f"saving {first} in {self.save_dir} failed: {failure}; the previous checkpoint is intact"
            )
        meta = {
            "format": meta_file.FORMAT_VERSION,
            "arch": self.arch,
            "task": self.task,
            "world_size": self.ctx.world_size,
            "layout": self.ctx.layout,
            **describe,
        }
        state = {}
        for key, stateful in states.items():
            value = stateful.state_dict()
            if _holds_tensors(value):
                state[key] = value
            elif key in meta:
                raise ValueError(f"a state named {key!r} would replace distlm.json's own {key!r}; rename it")
            else:
                meta[key] = value
        started = time.perf_counter()
        try:
            writer = integrity.HashingWriter(staged)  # checksums while writing: no read-back at the commit
            if self.settings.async_save:
                with _single_process_quiet():
                    future = dcp.async_save(state, checkpoint_id=str(staged), process_group=self._async_group,
                                            no_dist=not self.ctx.is_distributed, storage_writer=writer)
                self._pending = (future, names, meta, writer)
                logger.info("checkpoint %s: staged in %.2f s, writing in the background", first,
                            time.perf_counter() - started)
                return
            with _single_process_quiet():
                dcp.save(state, checkpoint_id=str(staged), no_dist=not self.ctx.is_distributed, storage_writer=writer)
        except (dcp.CheckpointException, OSError) as err:
            self._abandon(names, err)
        self._commit(names, meta, writer.hashed())
        logger.info("saved %s in %.2f s", ", ".join(names), time.perf_counter() - started)

    def wait(self) -> None:
        """Complete an asynchronous save still being written (collective)."""
        if self._pending is None:
            return
        future, names, meta, writer = self._pending
        self._pending = None
        with self.ctx.naming_failed_collectives(meta["progress"]["num_updates"]):
            try:
                future.result()
            except (dcp.CheckpointException, OSError) as err:
                self._abandon(names, err)
            self._commit(names, meta, writer.hashed())
        logger.info("saved %s (written in the background)", ", ".join(names))

    def _commit(self, names: list[str], meta: dict[str, Any], hashed: dict[str, dict[str, Any]]) -> None:
        staged = directory.incomplete(self.save_dir, names[0])
        try:
            written = integrity.digests(staged, integrity.written_by(staged, self.ctx.rank), hashed)
        except OSError as err:
            written = _reason(err)
        # Also the barrier after which every rank's shards are written.
        gathered = self.ctx.all_gather_object(written)
        failure = next((result for result in gathered if isinstance(result, str)), None)
        if self.ctx.is_main and failure is None:
            failure = _unseen_shard(staged, gathered)
        if self.ctx.is_main and failure is None:
            failure = self._lock_lost()  # the last moment before the save would replace a checkpoint
        if self.ctx.is_main and failure is None:
            try:
                meta = {**meta, integrity.FILES_KEY: {name: entry for files in gathered for name, entry in files.items()}}
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
                failure = _reason(err)
        if self.ctx.is_main and failure is not None:
            shutil.rmtree(staged, ignore_errors=True)
        failure = self.ctx.all_gather_object(failure)[0]
        if failure is not None:
            raise CheckpointError(
                f"saving {', '.join(names)} in {self.save_dir} failed: {failure}; the previous checkpoint is intact"
            )

    def _lock_lost(self) -> str | None:
        """Rank 0: why the save dir is no longer this run's, or None (it is, or nothing is saved there)."""
        return self._lock.lost() if self._lock is not None else None

    def _abandon(self, names: list[str], err: BaseException) -> None:
        """End a save that failed on some rank: every rank raises, rank 0 removes the staged directory."""
        reason = _save_failure(err, self.save_dir)  # before the partial files free their space
        if self.ctx.is_main:
            shutil.rmtree(directory.incomplete(self.save_dir, names[0]), ignore_errors=True)
        raise CheckpointError(
            f"saving {', '.join(names)} in {self.save_dir} failed: {reason}; the previous checkpoint is intact"
        ) from None


def _unseen_shard(staged: Path, written: list[dict[str, dict[str, Any]]]) -> str | None:
    """Rank 0: the first file a rank wrote that ``staged`` does not hold as rank 0 sees it, in
    words, or None. A save dir that is not one file system (a mount lost, a node-local disk)
    keeps a rank's shards where no reader looks; committed, the checkpoint could not be read."""
    for rank, files in enumerate(written):
        unseen = shared_dir.unseen_files(staged, {name: entry["size"] for name, entry in files.items()})
        if unseen:
            return (f"shard {unseen[0]} written by rank {rank} is not in {staged} as rank 0 sees it: "
                    f"{shared_dir.REMEDY}")
    return None


def _unusable_save_dir(save_dir: Path) -> str | None:
    """Why checkpoints cannot be written into ``save_dir``, found by writing a file there
    (permission bits say nothing for root, a read-only mount or a full quota); None if they can."""
    if save_dir.exists() and not save_dir.is_dir():
        return f"--save-dir {save_dir} is a file; name a directory"
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"--save-dir {save_dir} cannot be created ({_reason(err)}); name a writable directory"
    probe = save_dir / f".distlm-write-test-{os.getpid()}-{socket.gethostname()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
    except OSError as err:
        return f"--save-dir {save_dir} is not writable ({err.strerror or err}); fix its permissions or name another directory"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def _incomplete(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be read (a metadata file missing), or None."""
    for name in (directory.META_FILE, directory.DCP_METADATA_FILE):
        if not (path / name).is_file():
            return f"{path} lacks {name}; the checkpoint is incomplete (remove it, or name another with --restore-file)"
    return None


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(item) for item in value)
    return False


def _prefixes(entries: dict[str, Any]) -> set[str]:
    """Every dotted prefix of the checkpoint's keys (``optimizer``, ``optimizer.norm``, ...)."""
    found = set()
    for key in entries:
        parts = key.split(".")
        found.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    return found


def _present(value: Any, key: str, entries: dict[str, Any], prefixes: set[str], path: Path) -> Any:
    """``value`` (a state dict, nested) without what the checkpoint does not hold; None if
    none of it. A tensor the checkpoint holds as a non-tensor entry is refused."""
    if isinstance(value, dict):
        kept = {name: _present(item, f"{key}.{name}", entries, prefixes, path) for name, item in value.items()}
        return {name: item for name, item in kept.items() if item is not None} or None
    if key not in prefixes:
        return None
    if isinstance(value, torch.Tensor) and isinstance(entries.get(key), BytesStorageMetadata):
        storage.refuse_non_tensor(path, key)
    return value


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


def _reason(err: OSError) -> str:
    return f"{err.strerror}: {err.filename}" if err.strerror and err.filename else err.strerror or str(err)


def _save_failure(err: BaseException, save_dir: Path) -> str:
    """One line for a failed write. torch's tensor writer reports a full disk as a
    RuntimeError about file positions ("unexpected pos 704 vs 598"), so a failed write with
    almost no space left on the save dir's file system is named for what it is."""
    if _is_enospc(err):
        return os.strerror(errno.ENOSPC)
    with contextlib.suppress(OSError):
        stats = os.statvfs(save_dir)
        if stats.f_bavail * stats.f_frsize < _LOW_SPACE_BYTES:
            return f"{os.strerror(errno.ENOSPC)} ({stats.f_bavail * stats.f_frsize} bytes free)"
    return storage.cause_line(err)


# A failed write that leaves less free space than this is taken for a full disk.
_LOW_SPACE_BYTES = 64 * 1024


def _is_enospc(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return err.errno == errno.ENOSPC
    return "No space left on device" in str(err) or f"Errno {errno.ENOSPC}" in str(err)
