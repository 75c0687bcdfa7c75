"""What a checkpoint's ``distlm.json`` records about the run, enough to export it: the
command-line config, the dictionary, tied weight names, the model's config and family,
for a Hugging Face model its special token ids, the trackers' run ids and the data files'
fingerprints; and the tokenizer, written into the checkpoint as Hugging Face files.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

from torch import nn

from distlm.checkpoint import TOKENIZER_DIR
from distlm.config import TrainConfig
from distlm.data.hf_tokenizer import save_tokenizer
from distlm.errors import UsageError
from distlm.runtime.agreement import data_files
from distlm.state.names import tied_aliases, unwrap
from distlm.training.builder import ModelSpec

logger = logging.getLogger("distlm")


def describe_run(config: TrainConfig, data: Any, model: nn.Module, spec: ModelSpec | None,
                 tracker_ids: dict[str, str] | None = None) -> dict[str, Any]:
    dictionary = getattr(data, "dictionary", None)
    model_config = getattr(unwrap(model), "config", None)
    return {
        "config": config.to_dict(),
        "dictionary": list(dictionary.symbols) if dictionary is not None else None,
        "tied_weights": tied_aliases(model),
        "family": spec.family.name if spec is not None else None,
        "model_config": dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else None,
        "special_tokens": _special_tokens(spec, dictionary),
        "trackers": tracker_ids or {},
        "data_files": data_files(config.data.data),
    }


def _special_tokens(spec: ModelSpec | None, dictionary: Any) -> dict[str, Any] | None:
    """The ids Hugging Face keeps in config.json: a Hugging Face model's own, else the dictionary's."""
    if spec is not None and spec.hf_tokens is not None:
        return dataclasses.asdict(spec.hf_tokens)
    if dictionary is None:
        return None
    return {"bos_token_id": dictionary.bos(), "eos_token_id": dictionary.eos(), "pad_token_id": dictionary.pad()}


def tokenizer_writer(data: Any, task: str) -> Callable[[Path], None]:
    """Writes the tokenizer the data was made with into a checkpoint directory (rank 0)."""

    def write(directory: Path) -> None:
        dictionary = getattr(data, "dictionary", None)
        if dictionary is None:
            return
        try:
            save_tokenizer(dictionary, directory / TOKENIZER_DIR, task)
        except UsageError as err:
            logger.info("checkpoint without tokenizer files: %s", err)

    return write
