"""Checkpoints of the single-file format (``checkpoint_last.pt``) that distlm wrote before
sharded checkpoints: read once, on resume, and converted by the next save.

That format holds the whole model and optimizer state under single-device names, every
rank's RNG state, and the training position, in one ``torch.save`` file.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path
from typing import Any

import torch

from distlm.checkpoint import meta as meta_file
from distlm.checkpoint import storage
from distlm.errors import UsageError

FORMAT_VERSION = 1
_REQUIRED = ("arch", "task", "model", "optimizer", "rng", "world_size", "num_updates", "consumed_samples")


def is_legacy(path: Path) -> bool:
    return path.is_file() and path.suffix == ".pt"


@functools.lru_cache(maxsize=1)
def read(path: Path) -> dict[str, Any]:
    """The whole file, loaded with ``weights_only=True``: a checkpoint is data, never code to run."""
    try:
        state = storage.load_data_only(path, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        raise UsageError(f"{path}: not a readable distlm checkpoint ({storage.read_failure(exc)})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise UsageError(f"{path}: not a distlm checkpoint of format {FORMAT_VERSION}")
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise UsageError(f"{path} holds no {missing[0]!r}; the checkpoint is damaged")
    return state


def read_meta(path: Path) -> dict[str, Any]:
    """The description the sharded format keeps in distlm.json, taken from the old file."""
    state = read(path)
    meta = {
        "arch": state["arch"],
        "task": state["task"],
        "world_size": state["world_size"],
        "layout": state.get("layout", {"dp": state["world_size"], "tp": 1}),
        "progress": {"num_updates": state["num_updates"], "consumed_samples": state["consumed_samples"]},
        "scaler": state.get("scaler"),
        "dictionary": state.get("dictionary"),
        "config": state.get("config"),
        "tied_weights": _tied(state["model"]),
    }
    meta_file.check(meta, path)
    return meta


def _tied(model: dict[str, torch.Tensor]) -> dict[str, str]:
    """Names whose tensor shares storage with an earlier name (torch.save keeps the sharing)."""
    first: dict[tuple, str] = {}
    aliases = {}
    for name, tensor in model.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases
