"""When a checkpoint is due, and under which names: fairseq's rule."""

from __future__ import annotations

from distlm.checkpoint import directory
from distlm.config import CheckpointConfig


def names_due(settings: CheckpointConfig, num_updates: int, end_of_epoch: int | None, done: bool,
              saved_at: int | None) -> list[str]:
    """Names to save now (``end_of_epoch``: the epoch that just ended, if one did;
    ``saved_at``: the update the newest checkpoint, saved or resumed from, holds).

    fairseq's rule: a save is due every ``--save-interval-updates`` updates, at the end
    of every ``--save-interval``-th epoch and when training stops. It writes
    ``checkpoint_<updates>`` at an interval inside an epoch, ``checkpoint<epoch>`` at
    the end of a due epoch (unless ``--no-epoch-checkpoints``) and ``checkpoint_last``
    (unless ``--no-last-checkpoints``). Nothing is due while the update count has not
    moved since the newest checkpoint: a skipped update (fp16 overflow, the first update
    of double buffering) or a run that resumes finished would write the same checkpoint
    again. The one exception is an epoch that ends on such an update: its
    ``checkpoint<epoch>`` is a name not yet written.
    """
    epoch_due = end_of_epoch is not None and end_of_epoch % settings.save_interval == 0
    if num_updates == saved_at:
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
