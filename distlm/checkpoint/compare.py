"""What differs between a checkpoint and the run resuming it: the model, and the settings.

A model whose names or shapes differ from the checkpoint's is refused before anything
is loaded (``first_model_difference``), and so is data that changed under the saved
position (``data_difference``); changed training settings are one log line
(``changed_settings``), which says how the data position carries over when the change
moves it.
"""

from __future__ import annotations

from typing import Any

# Settings that say when to stop, where to log or validate, or how to read: changing
# them on resume is routine and changes nothing trained.
_NOT_COMPARED = {
    "optim": {"max_update", "max_epoch"},
    "data": {"num_workers", "valid_subset", "disable_validation", "validate_interval", "validate_interval_updates",
             "max_valid_steps", "batch_size_valid"},
    "precision": {"allow_slow_fp16"},
    "model": {"init_from_hf"},
}
_COMPARED_SECTIONS = ("model", "data", "optim", "precision")
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
                     consumed_samples: int) -> str | None:
    """One line listing the training settings that differ from the checkpoint's, or None."""
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
                 f"reads on from sample {consumed_samples} of the same order, {batch_now} samples per update")
    return line


def _global_batch(data: Any, dp: int | None) -> int | None:
    if not isinstance(data, dict) or not isinstance(dp, int):
        return None
    batch, freq = data.get("batch_size"), data.get("update_freq")
    return batch * freq * dp if isinstance(batch, int) and isinstance(freq, int) else None


def _same(before: Any, now: Any) -> bool:
    # distlm.json keeps tuples as lists.
    if isinstance(before, (list, tuple)) and isinstance(now, (list, tuple)):
        return list(before) == list(now)
    return before == now


def _show(value: Any) -> str:
    return "none" if value is None else str(value)
