"""What differs between a checkpoint and the run resuming it: the model, and the settings.

A model whose names or shapes differ from the checkpoint's is refused before anything
is loaded (``first_model_difference``), and so is data that changed under the saved
position (``data_difference``); changed training settings are one log line
(``changed_settings``), which says how the data position carries over when the change
moves it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from distlm.config import OptimConfig
from distlm.optim import LRSchedule

# Settings that say where to log or validate, how to read, how long to wait, or who this
# rank is: changing them on resume is routine and changes nothing trained.
_NOT_COMPARED = {
    "data": {"num_workers", "valid_subset", "disable_validation", "validate_interval", "validate_interval_updates",
             "max_valid_steps", "batch_size_valid"},
    "precision": {"allow_slow_fp16"},
    "model": {"init_from_hf"},
    "distributed": {"timeout_sec", "check_replicas", "distributed_world_size", "distributed_rank",
                    "distributed_init_method"},
}
_COMPARED_SECTIONS = ("model", "data", "optim", "precision", "distributed")
# Settings that change which text a count of consumed samples stands for.
_SAMPLE_SETTINGS = ("data", "tokens_per_sample", "sample_break_mode")


def first_model_difference(saved: dict[str, tuple[int, ...]], built: dict[str, tuple[int, ...]]) -> str | None:
    """The first name or shape in which the checkpoint's model and the model built differ, or None."""
    for name, shape in built.items():
        if name not in saved:
            return f"the model built has {name}, the checkpoint does not"
        if tuple(saved[name]) != tuple(shape):
            return f"{name} is {list(saved[name])} in the checkpoint, {list(shape)} in the model built"
    for name in saved:
        if name not in built:
            return f"the checkpoint has {name}, the model built does not"
    return None


def data_difference(saved: Any, now: dict[str, str] | None) -> str | None:
    """The first data file that differs from the one the checkpoint was trained on, as a
    phrase, or None (the same files, or a checkpoint that did not record them)."""
    if not isinstance(saved, dict) or now is None:
        return None
    for name, entry in now.items():
        if name not in saved:
            return f"{name} was not there when the checkpoint was saved"
        if saved[name] != entry:
            return f"{name} changed ({saved[name]} then, {entry} now)"
    for name in saved:
        if name not in now:
            return f"{name} is gone"
    return None


def shared_weights(saved: dict[str, tuple[int, ...]], built: dict[str, tuple[int, ...]]) -> tuple[list[str], list[str]]:
    """(names to load, names left out) of a partial load: those with the same shape in both load."""
    shared = [name for name, shape in built.items() if name in saved and tuple(saved[name]) == tuple(shape)]
    left_out = [name for name in built if name not in shared] + [name for name in saved if name not in built]
    return shared, left_out


def changed_settings(saved: dict[str, Any] | None, config: dict[str, Any], saved_dp: int | None, dp: int,
                     consumed_samples: int, updates: int) -> str | None:
    """One line listing the training settings that differ from the checkpoint's (at update
    ``updates``), and where the learning-rate schedule moves with them; or None."""
    if not isinstance(saved, dict):
        return None
    changes = []
    for section in _COMPARED_SECTIONS:
        before, now = saved.get(section), config.get(section)
        if not isinstance(before, dict) or not isinstance(now, dict):
            continue
        for key, value in now.items():
            if key in _NOT_COMPARED.get(section, ()) or key not in before or _same(before[key], value):
                continue
            changes.append(f"{key.replace('_', '-')} {_show(before[key])} → {_show(value)}")
    if "seed" in saved and saved["seed"] != config.get("seed"):
        changes.append(f"seed {saved['seed']} → {config.get('seed')}")
    batch_before = _global_batch(saved.get("data"), saved_dp)
    batch_now = _global_batch(config.get("data"), dp)
    if batch_before is not None and batch_now is not None and batch_before != batch_now:
        changes.append(f"global batch {batch_before} → {batch_now}")
    moved_lr = _schedule_move(saved.get("optim"), config.get("optim"), updates)
    if moved_lr is not None:
        changes.append(moved_lr)
    if not changes:
        return None
    line = "resuming with " + ", ".join(changes)
    before_data, now_data = saved.get("data") or {}, config.get("data") or {}
    moved = [key.replace("_", "-") for key in _SAMPLE_SETTINGS
             if key in before_data and not _same(before_data[key], now_data.get(key))]
    if moved:
        line += (f"; the data position carries over as {consumed_samples} samples consumed, which under the new "
                 f"{', '.join('--' + name for name in moved)} are other text than the run read: add "
                 "--reset-dataloader to start the data from its beginning")
    elif batch_before is not None and batch_now is not None and batch_before != batch_now:
        line += (f"; the data position carries over as {consumed_samples} samples consumed: the next update "
                 f"reads on from sample {consumed_samples} of the same order, "
                 f"{batch_now}{'' if isinstance(batch_now, str) else ' samples'} per update")
    return line


def _schedule_move(before: Any, now: Any, updates: int) -> str | None:
    """Where the next update's learning rate differs from the one the checkpoint's schedule
    gave it (a changed --max-update moves a decaying schedule), as a phrase; or None."""
    if not isinstance(before, dict) or not isinstance(now, dict):
        return None
    names = {field.name for field in dataclasses.fields(OptimConfig)}
    try:
        then = LRSchedule(OptimConfig(**{k: v for k, v in before.items() if k in names})).lr_at(updates + 1)
        next_lr = LRSchedule(OptimConfig(**{k: v for k, v in now.items() if k in names})).lr_at(updates + 1)
    except (TypeError, ValueError):
        return None  # a checkpoint's optim section that is not one: no schedule to compare
    if math.isclose(then, next_lr, rel_tol=1e-9, abs_tol=0.0):
        return None
    return f"the learning-rate schedule moves: update {updates + 1} gets lr {next_lr:.4g}, the saved schedule's {then:.4g}"


def _global_batch(data: Any, dp: int | None) -> int | str | None:
    if not isinstance(data, dict) or not isinstance(dp, int):
        return None
    batch, freq = data.get("batch_size"), data.get("update_freq")
    if isinstance(data.get("max_tokens"), int) and isinstance(freq, int):
        # Batches of a token budget hold varying numbers of samples: an update is a count of batches.
        return f"{freq * dp} --max-tokens batches"
    return batch * freq * dp if isinstance(batch, int) and isinstance(freq, int) else None


def _same(before: Any, now: Any) -> bool:
    # distlm.json keeps tuples as lists.
    if isinstance(before, (list, tuple)) and isinstance(now, (list, tuple)):
        return list(before) == list(now)
    return before == now


def _show(value: Any) -> str:
    return "none" if value is None else str(value)
