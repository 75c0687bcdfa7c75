"""A checkpoint as a Hugging Face model directory, for transformers, vLLM and TGI.

Weights are read from the checkpoint's shards one tensor at a time and converted by the
model's adapter (distlm/models/hf/), so an 8B export needs about one tensor in memory,
no process group and none of the optimizer's bytes. The tokenizer files saved with the
checkpoint are copied beside them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from distlm.checkpoint import TOKENIZER_DIR, CheckpointReader
from distlm.checkpoint.directory import META_FILE
from distlm.errors import UsageError, first_line
from distlm.export.target import check_directory_target, copy_regular_files, staged_directory
from distlm.models import registry
from distlm.models.hf import SpecialTokens, write_hf_directory
from distlm.models.hf.io import DEFAULT_MAX_SHARD_SIZE, parse_size

logger = logging.getLogger("distlm")


def checked_model_config(reader: CheckpointReader) -> Any | None:
    """The config of the distlm model a checkpoint holds, None for a model of the user's own.

    The shapes of the checkpoint's weights are checked against the model it describes
    (built on the meta device) before any weight is read, as a resume checks them
    against the model it built: checksums are not signatures, and an export allocates
    each tensor from the shape the metadata gives it.
    """
    family, model_config = reader.meta.get("family"), reader.meta.get("model_config")
    if family not in registry.families() or model_config is None:
        return None
    bundle = registry.family(family)
    try:
        config = bundle.config_class(**model_config)
        with torch.device("meta"):
            built = bundle.model_class(config).state_dict()
    except (TypeError, ValueError, ArithmeticError) as err:
        raise UsageError(f"{reader.path / META_FILE}: model_config does not describe a {family} model "
                         f"({first_line(err)}); the checkpoint is damaged") from None
    reader.check_model({name: tuple(tensor.shape) for name, tensor in built.items()},
                       f"its {META_FILE} describes")
    return config


def export_hf(checkpoint_path: str, out_dir: str, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
              verify: bool = True, overwrite: bool = False) -> list[Path]:
    """Write ``out_dir`` from a checkpoint (directory, save dir or old single file); returns the files.

    ``verify``: check the checkpoint's files against their recorded checksums first. ``out_dir`` is
    replaced whole once the export is complete (see distlm/export/target.py); one that holds anything
    but an earlier export needs ``overwrite``.
    """
    parse_size(max_shard_size)  # a bad size fails before anything is read
    out = Path(out_dir)
    check_directory_target(out, "--hf", overwrite)
    reader = CheckpointReader(checkpoint_path, verify=verify)
    meta = reader.meta
    config = checked_model_config(reader)
    if config is None:
        raise UsageError(
            f"--checkpoint {reader.path} holds a {meta.get('arch')} model with no Hugging Face layout "
            "(distlm exports its Llama, RoBERTa and mixture-of-experts models; a checkpoint of an older release "
            "lacks the model config: resume it once and save again)"
        )
    names = reader.model_names()
    shapes = {name: reader.tensor_spec(f"model.{name}") for name in names}
    meta_tensors = {name: torch.empty(size, dtype=dtype, device="meta") for name, (size, dtype) in shapes.items()}
    tokens = SpecialTokens(**(meta.get("special_tokens") or {}))
    source = {"checkpoint": str(reader.path), "num_updates": meta.get("progress", {}).get("num_updates")}
    with staged_directory(out, "--hf", source) as stage:
        written = write_hf_directory(stage, config, meta_tensors, lambda name: reader.tensor(f"model.{name}"), tokens,
                                     max_shard_size=max_shard_size)
        tokenizer = reader.path / TOKENIZER_DIR if reader.path.is_dir() else None
        if tokenizer is not None and tokenizer.is_dir():
            written += copy_regular_files(tokenizer, stage, reader.path)
        else:
            logger.warning("%s holds no tokenizer files (its data's dict.txt has no tokenizer distlm knows); "
                           "copy your tokenizer's files into %s", reader.path, out)
    return [out / path.name for path in written]
