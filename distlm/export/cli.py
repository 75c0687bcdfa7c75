"""``python -m distlm.export --checkpoint PATH --out FILE.safetensors | --hf OUT_DIR``: the trained model.

``--out`` writes the weights in one safetensors file under distlm's names (safetensors.py);
``--hf`` writes a Hugging Face model directory (hf.py).

``PATH`` is a checkpoint directory, a save dir (meaning its ``checkpoint_last``) or a
checkpoint of the old single-file format.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from distlm.errors import OneLineErrorParser, UsageError
from distlm.export.hf import export_hf
from distlm.export.safetensors import export
from distlm.models.hf.io import DEFAULT_MAX_SHARD_SIZE


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
