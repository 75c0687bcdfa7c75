"""``python -m distlm.export --checkpoint PATH --out FILE.safetensors | --hf OUT_DIR``: the trained model.

``--out`` writes the weights in one safetensors file under distlm's names; ``--hf``
writes a Hugging Face model directory (see hf_export.py).

``PATH`` is a checkpoint directory, a save dir (meaning its ``checkpoint_last``) or a
checkpoint of the old single-file format. Parameter names are those of the
single-device model, stable whatever strategy trained it. Tensors are read from the
shards one at a time, never the optimizer's, and streamed into the file (its header
comes from the checkpoint's metadata), so exporting holds about one tensor in memory
and needs no process group. Tied weights are stored once; the names that alias them
are listed in the file's metadata.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from distlm.checkpoint import CheckpointReader
from distlm.errors import OneLineErrorParser, UsageError
from distlm.export_target import check_file_target
from distlm.hf_export import checked_model_config, export_hf
from distlm.models.hf.io import DEFAULT_MAX_SHARD_SIZE, TensorSpec, write_safetensors_file


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m distlm.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory, or a save dir (its checkpoint_last), e.g. checkpoints")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="output .safetensors file (distlm's own names)")
    target.add_argument("--hf", metavar="OUT_DIR",
                        help="Hugging Face model directory: config.json, sharded safetensors, tokenizer files")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help=f"with --hf: largest safetensors file, e.g. 5GB or 500MB (default: {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--no-verify-checkpoint", action="store_true",
                        help="do not verify the checkpoint's files against the checksums its save recorded")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an --hf directory or --out file that is not an earlier distlm export")
    try:
        args = parser.parse_args(argv)
        verify = not args.no_verify_checkpoint
        if args.hf is not None:
            export_hf(args.checkpoint, args.hf, args.max_shard_size, verify=verify, overwrite=args.overwrite)
            path = Path(args.hf)
        else:
            path = export(args.checkpoint, args.out, verify=verify, overwrite=args.overwrite)
    except UsageError as exc:
        print(f"distlm.export: error: {exc}", file=sys.stderr)
        return UsageError.exit_code
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
