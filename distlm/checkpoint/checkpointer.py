"""``Checkpointer``: the one object the trainer saves and resumes through.

Every rank writes its own shards with torch.distributed.checkpoint and reads only the
slices its shards need, so no rank ever holds the whole model or optimizer, and a
checkpoint written under one (strategy, dp, tp) layout resumes under any other. Rank 0
writes ``distlm.json`` beside the shards: what the checkpoint is (arch, task,
dictionary, config) and where training stood (updates, consumed samples, loss scaler,
best validation). See directory.py for how a checkpoint appears atomically.

Each job has its module: the save dir's preparation (save_dir.py), which checkpoint to
resume from (resume.py), loading (loading.py), when a save is due (cadence.py) and
saving (saving.py). The Checkpointer orders them and remembers which update the newest
checkpoint holds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

from torch.distributed.checkpoint.stateful import Stateful

from distlm.checkpoint import directory
from distlm.checkpoint.cadence import names_due
from distlm.checkpoint.loading import CheckpointLoader
from distlm.checkpoint.resume import Resume, find_resume
from distlm.checkpoint.save_dir import SaveDir
from distlm.checkpoint.saving import CheckpointSaver
from distlm.checkpoint.stateful import PROGRESS
from distlm.config import CheckpointConfig
from distlm.runtime.context import DistContext

logger = logging.getLogger("distlm")


class Checkpointer:
    """Prepares the save dir, finds and loads the checkpoint to resume from, and saves when due."""

    def __init__(self, settings: CheckpointConfig, ctx: DistContext, arch: str, task: str):
        self.settings = settings
        self.ctx = ctx
        self.arch, self.task = arch, task
        self.save_dir = Path(settings.save_dir)
        self._dir = SaveDir(self.save_dir, ctx)
        self._saver = CheckpointSaver(settings, ctx, arch, task, self._dir.lost)
        self._saved_at: int | None = None
        """The update the newest checkpoint (saved or resumed from) holds: saving it again would repeat it."""

    @property
    def enabled(self) -> bool:
        return not self.settings.no_save

    def prepare(self) -> None:
        """Check the save dir before training and clean up after a killed save (collective)."""
        if not self.enabled:
            return
        self._dir.prepare()
        self._saver.prepare()

    def find_resume(self) -> Resume | None:
        """The checkpoint to resume from, the same on every rank, or None (collective)."""
        return find_resume(self.settings, self.ctx, self.arch, self.task)

    def load(self, resume: Resume, states: Mapping[str, Stateful], seed: int,
             config: dict[str, Any] | None = None) -> None:
        """Load ``resume`` into ``states`` (collective): the model's shards, and unless only
        the weights are wanted, every other state the checkpoint holds. ``config``, the
        run's settings, is compared with the checkpoint's and the changes logged."""
        CheckpointLoader(self.settings, self.ctx).load(resume, states, seed, config)
        self._saved_at = states[PROGRESS].num_updates

    def due(self, num_updates: int, end_of_epoch: int | None, done: bool) -> list[str]:
        """Names to save now (``end_of_epoch``: the epoch that just ended, if one did); see
        ``cadence.names_due`` for fairseq's rule."""
        if not self.enabled:
            return []
        return names_due(self.settings, num_updates, end_of_epoch, done, self._saved_at)

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
        num_updates = states[PROGRESS].num_updates
        with self.ctx.naming_failed_collectives(num_updates):
            self._saved_at = num_updates
            self._saver.save(names, states, describe, write_extras)

    @property
    def writing(self) -> bool:
        """Whether an asynchronous save of this rank's is still being written in the background."""
        return self._saver.writing

    def wait(self) -> None:
        """Complete an asynchronous save still being written (collective)."""
        self._saver.wait()

    def close(self) -> None:
        """Give up the save dir (rank 0 removes its lock); the run is over."""
        self._dir.release()

    def announce_last(self) -> None:
        """Rank 0 says where the last checkpoint is and how to export it."""
        last = self.save_dir / directory.LAST
        if self.ctx.is_main and self.enabled and last.is_dir():
            logger.info("last checkpoint: %s; export it with: python -m distlm.export --checkpoint %s --hf OUT_DIR",
                        last, last)
