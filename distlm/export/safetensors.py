"""A checkpoint's weights in one safetensors file under distlm's names (``--out``).

Parameter names are those of the single-device model, stable whatever strategy trained
it. Tensors are read from the shards one at a time, never the optimizer's, and streamed
into the file (its header comes from the checkpoint's metadata), so exporting holds about
one tensor in memory and needs no process group. Tied weights are stored once; the names
that alias them are listed in the file's metadata.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from distlm.checkpoint import CheckpointReader
from distlm.errors import UsageError
from distlm.export.hf import checked_model_config
from distlm.export.target import check_file_target
from distlm.models.hf.io import TensorSpec, write_safetensors_file


def export(checkpoint_path: str, out: str, verify: bool = True, overwrite: bool = False) -> Path:
    target = Path(out)
    check_file_target(target, "--out", overwrite)
    try:
        reader = CheckpointReader(checkpoint_path, verify=verify)
        checked_model_config(reader)
    except UsageError as err:
        raise UsageError(f"--checkpoint {err}") from None
    meta = reader.meta
    aliases = meta.get("tied_weights") or {}
    specs = []
    for name in reader.model_names():
        if name not in aliases:
            shape, dtype = reader.tensor_spec(f"model.{name}")
            specs.append(TensorSpec(name, tuple(shape), dtype))
    metadata = {
        "format": "distlm",
        "arch": meta["arch"],
        "task": meta["task"],
        "num_updates": str(meta["progress"]["num_updates"]),
        "tied_weights": json.dumps(aliases),
        "dictionary": json.dumps(meta.get("dictionary")),
    }
    partial = target.with_name(f".{target.name}.incomplete")  # renamed into place when whole
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors_file(partial, specs, lambda name: reader.tensor(f"model.{name}"), metadata)
        os.replace(partial, target)
    except BaseException as exc:  # a checkpoint that cannot be read, a write that fails, an interrupt
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        if not isinstance(exc, (OSError, ValueError)):
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(f"--out {out}: cannot write ({reason})") from None
    return target
