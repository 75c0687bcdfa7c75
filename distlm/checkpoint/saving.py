"""Writing a checkpoint: staged, written by every rank, checked, then committed under its names.

Rank 0 stages ``.incomplete-<name>`` (with the small files a run adds, the tokenizer);
every rank writes its own shards there with torch.distributed.checkpoint, hashing them as
they are written, in the background with ``--async-save``. The commit gathers every
rank's file list, checks that rank 0 sees each shard (a save dir that is not one file
system would keep some elsewhere) and that the save dir is still this run's, writes
``distlm.json`` with the checksums, renames the checkpoint into place under each name
(directory.py) and applies the retention flags. A failure on any rank ends the save on
every rank in one line, and the previous checkpoint stays intact.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from distlm.checkpoint import directory, integrity, shared_dir, storage
from distlm.checkpoint import meta as meta_file
from distlm.checkpoint.failures import CheckpointError, os_reason, save_failure
from distlm.config import CheckpointConfig
from distlm.errors import UsageError
from distlm.runtime.context import DistContext

logger = logging.getLogger("distlm")


class CheckpointSaver:
    """Writes checkpoints into the save dir, one at a time, synchronously or in the background.

    ``save_dir_lost`` answers, on rank 0, why the save dir is no longer this run's (None
    while it is): asked before a save stages anything and again before its commit.
    """

    def __init__(self, settings: CheckpointConfig, ctx: DistContext, arch: str, task: str,
                 save_dir_lost: Callable[[], str | None]):
        self.settings = settings
        self.ctx = ctx
        self.arch, self.task = arch, task
        self.save_dir = Path(settings.save_dir)
        self._save_dir_lost = save_dir_lost
        self._pending: tuple[Future, list[str], dict[str, Any], integrity.HashingWriter] | None = None
        self._async_group = None

    def prepare(self) -> None:
        """Create the process group of background saves (collective), if they are asked for."""
        if self.settings.async_save and self.ctx.is_distributed:
            # Background saves run their collectives on a group of their own, so they never
            # interleave with the training loop's collectives on the default group.
            self._async_group = dist.new_group(backend="gloo")

    def save(
        self,
        names: list[str],
        states: Mapping[str, Stateful],
        describe: dict[str, Any],
        write_extras: Callable[[Path], None] | None,
    ) -> None:
        """Write ``states`` as one checkpoint under ``names`` (collective); with --async-save
        only staged here, and completed by ``wait``."""
        first = names[0]
        staged = directory.incomplete(self.save_dir, first)
        lost = failure = None
        if self.ctx.is_main:
            lost = self._save_dir_lost()
        if self.ctx.is_main and lost is None:
            try:
                shutil.rmtree(staged, ignore_errors=True)
                staged.mkdir(parents=True)
                if write_extras is not None:
                    write_extras(staged)
            except OSError as err:
                shutil.rmtree(staged, ignore_errors=True)
                failure = os_reason(err)
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
                with storage.single_process_quiet():
                    future = dcp.async_save(state, checkpoint_id=str(staged), process_group=self._async_group,
                                            no_dist=not self.ctx.is_distributed, storage_writer=writer)
                self._pending = (future, names, meta, writer)
                logger.info("checkpoint %s: staged in %.2f s, writing in the background", first,
                            time.perf_counter() - started)
                return
            with storage.single_process_quiet():
                dcp.save(state, checkpoint_id=str(staged), no_dist=not self.ctx.is_distributed, storage_writer=writer)
        except (dcp.CheckpointException, OSError) as err:
            self._abandon(names, err)
        self._commit(names, meta, writer.hashed())
        logger.info("saved %s in %.2f s", ", ".join(names), time.perf_counter() - started)

    @property
    def writing(self) -> bool:
        """Whether an asynchronous save of this rank's is still being written."""
        return self._pending is not None and not self._pending[0].done()

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
        """Check what every rank wrote and move the staged checkpoint into place under each
        of ``names`` (collective; rank 0 writes and renames)."""
        staged = directory.incomplete(self.save_dir, names[0])
        try:
            written = integrity.digests(staged, integrity.written_by(staged, self.ctx.rank), hashed)
        except OSError as err:
            written = os_reason(err)
        # Also the barrier after which every rank's shards are written.
        gathered = self.ctx.all_gather_object(written)
        failure = next((result for result in gathered if isinstance(result, str)), None)
        if self.ctx.is_main and failure is None:
            failure = _unseen_shard(staged, gathered)
        if self.ctx.is_main and failure is None:
            failure = self._save_dir_lost()  # the last moment before the save would replace a checkpoint
        if self.ctx.is_main and failure is None:
            try:
                recorded = {name: entry for files in gathered for name, entry in files.items()}
                meta = {**meta, integrity.FILES_KEY: recorded}
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
                failure = os_reason(err)
        if self.ctx.is_main and failure is not None:
            shutil.rmtree(staged, ignore_errors=True)
        failure = self.ctx.all_gather_object(failure)[0]
        if failure is not None:
            raise CheckpointError(
                f"saving {', '.join(names)} in {self.save_dir} failed: {failure}; the previous checkpoint is intact"
            )

    def _abandon(self, names: list[str], err: BaseException) -> None:
        """End a save that failed on some rank: every rank raises, rank 0 removes the staged directory."""
        reason = save_failure(err, self.save_dir)  # before the partial files free their space
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


def _holds_tensors(value: Any) -> bool:
    """Whether a state holds a tensor anywhere (it goes into the shards), or is plain data (into distlm.json)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(item) for item in value)
    return False


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """``value`` as JSON at ``path``, on disk before the commit's rename publishes it."""
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
