"""``distlm.json``: what a checkpoint says about itself, and the check that it says enough.

The Checkpointer writes it beside the shards. Resume, export and the offline reader all
read it through ``read`` here, so a damaged or hand-edited file ends in one line naming
the file and the key wherever it is read, never in a KeyError later on.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from distlm.checkpoint import directory
from distlm.errors import UsageError
from distlm.models import registry

FORMAT_VERSION = 2

_REQUIRED = ("arch", "task", "progress", "world_size", "layout")
_PROGRESS_FIELDS = {"num_updates": int, "consumed_samples": int}
_SCALER_FIELDS = {"scale": (int, float), "clean_updates": int}


def read(path: Path) -> dict[str, Any]:
    """The checked description of the checkpoint directory ``path``."""
    file = path / directory.META_FILE
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"{file}: not readable ({err}); the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise UsageError(f"{path}: checkpoint format {found}, this distlm reads {FORMAT_VERSION}")
    check(meta, file)
    return meta


def check(meta: dict[str, Any], where: Path) -> None:
    """Every key a resume or an export reads is there, with a value of its kind."""
    for key in _REQUIRED:
        if key not in meta:
            raise UsageError(f"{where} holds no {key!r}; the checkpoint is damaged")
    _check_fields(meta["progress"], _PROGRESS_FIELDS, "progress", where)
    for key in _PROGRESS_FIELDS:
        if meta["progress"][key] < 0:
            raise UsageError(f"{where}: progress.{key} is {meta['progress'][key]}, below 0; the checkpoint is damaged")
    if meta.get("scaler") is not None:
        _check_fields(meta["scaler"], _SCALER_FIELDS, "scaler", where)
    _check_model_config(meta.get("family"), meta.get("model_config"), where)


def _check_model_config(family: Any, model_config: Any, where: Path) -> None:
    """The model settings an export builds its config from name only settings of the family's model."""
    if model_config is None or family not in registry.families():
        return
    if not isinstance(model_config, dict):
        raise UsageError(f"{where}: 'model_config' is not a table; the checkpoint is damaged")
    known = {field.name for field in dataclasses.fields(registry.family(family).config_class)}
    unknown = sorted(set(model_config) - known)
    if unknown:
        raise UsageError(f"{where}: model_config.{unknown[0]} is not a setting of distlm's {family} model; "
                         "the checkpoint is damaged or from another version")


def _check_fields(section: Any, fields: dict[str, type | tuple[type, ...]], name: str, where: Path) -> None:
    if not isinstance(section, dict):
        raise UsageError(f"{where}: {name!r} is not a table; the checkpoint is damaged")
    for key, kind in fields.items():
        if key not in section:
            raise UsageError(f"{where} holds no {name}.{key}; the checkpoint is damaged")
        value = section[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise UsageError(f"{where}: {name}.{key} is {value!r}, not a number; the checkpoint is damaged")
