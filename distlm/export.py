"""``python -m distlm.export --checkpoint PATH --out FILE.safetensors``: the model's weights in one file.

``PATH`` is a checkpoint directory, a save dir (meaning its ``checkpoint_last``) or a
checkpoint of the old single-file format. Parameter names are those of the
single-device model, stable whatever strategy trained it. Tensors are read from the
shards one at a time and never the optimizer's, so exporting needs about one copy of
the weights in memory and no process group. Tied weights are stored once; the names
that alias them are listed in the file's metadata.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from safetensors import SafetensorError
from safetensors.torch import save_file

from distlm.checkpoint import CheckpointReader
from distlm.config import OneLineErrorParser
from distlm.errors import UsageError


def export(checkpoint_path: str, out: str) -> Path:
    target = Path(out)
    if target.is_dir():
        raise UsageError(f"--out {out} is a directory; name the .safetensors file to write")
    try:
        reader = CheckpointReader(checkpoint_path)
    except UsageError as err:
        raise UsageError(f"--checkpoint {err}") from None
    meta = reader.meta
    aliases = meta.get("tied_weights") or {}
    weights = {name: tensor.contiguous() for name, tensor in reader.model_tensors() if name not in aliases}
    metadata = {
        "format": "distlm",
        "arch": meta["arch"],
        "task": meta["task"],
        "num_updates": str(meta["progress"]["num_updates"]),
        "tied_weights": json.dumps(aliases),
        "dictionary": json.dumps(meta.get("dictionary")),
    }
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(target), metadata=metadata)
    except (OSError, SafetensorError) as exc:
        raise UsageError(f"--out {out}: cannot write ({exc})") from None
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m distlm.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory, or a save dir (its checkpoint_last), e.g. checkpoints")
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
