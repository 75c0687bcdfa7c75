"""``python -m distlm.export --checkpoint PATH --out FILE.safetensors``: consolidated model weights.

Parameter names are those of the single-device model (no ``module.`` or compile
prefixes), so they stay stable whatever strategy trained the model. Tied weights are
stored once; the names that alias them are listed in the file's metadata.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

from distlm import checkpoint
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
    if not Path(checkpoint_path).is_file():
        raise UsageError(f"--checkpoint {checkpoint_path}: no such file")
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
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(target), metadata=metadata)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlm.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a distlm checkpoint, e.g. checkpoints/checkpoint_last.pt")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    args = parser.parse_args(argv)
    try:
        path = export(args.checkpoint, args.out)
    except UsageError as exc:
        print(f"distlm.export: error: {exc}", file=sys.stderr)
        return UsageError.exit_code
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
