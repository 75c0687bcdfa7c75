"""``python -m distlm.export --checkpoint PATH --out FILE.safetensors``: consolidated model weights.

Parameter names are those of the single-device model (no ``module.`` or compile
prefixes), so they stay stable whatever strategy trained the model. Tied weights are
stored once; the names that alias them are listed in the file's metadata.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from distlm import checkpoint
from distlm.config import OneLineErrorParser
from distlm.errors import UsageError


def consolidated_weights(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that share storage with an earlier one (tied weights); report the aliases."""
    weights: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        weights[name] = tensor.detach().contiguous()
    return weights, aliases


def export(checkpoint_path: str, out: str) -> Path:
    source, target = Path(checkpoint_path), Path(out)
    if source.is_dir():
        raise UsageError(f"--checkpoint {checkpoint_path} is a directory; name a file such as {source / checkpoint.LAST}")
    if not source.is_file():
        raise UsageError(f"--checkpoint {checkpoint_path}: no such file")
    if target.is_dir():
        raise UsageError(f"--out {out} is a directory; name the .safetensors file to write")
    state = checkpoint.load(checkpoint_path)
    weights, aliases = consolidated_weights(state["model"])
    metadata = {
        "format": "distlm",
        "arch": state["arch"],
        "task": state["task"],
        "num_updates": str(state["num_updates"]),
        "tied_weights": json.dumps(aliases),
        "dictionary": json.dumps(state["dictionary"]),
    }
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(target), metadata=metadata)
    except (OSError, SafetensorError) as exc:
        raise UsageError(f"--out {out}: cannot write ({exc})") from None
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m distlm.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a distlm checkpoint, e.g. checkpoints/checkpoint_last.pt")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    try:
        args = parser.parse_args(argv)
        path = export(args.checkpoint, args.out)
    except UsageError as exc:
        print(f"distlm.export: error: {exc}", file=sys.stderr)
        return UsageError.exit_code
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
