"""The training objective: summed cross-entropy over a batch's target tokens.

The sum, not the mean: the trainer divides once by the global number of target tokens
of the update, so every token weighs the same whatever rank or micro-batch holds it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlm.data.masking import IGNORE_INDEX
from distlm.models.family import TASK_RECORDS


@dataclass(frozen=True)
class ModelInputs:
    """Which optional forward arguments a model takes (read from its signature once)."""

    masked_tokens: bool = False
    """A masked LM computing logits at the masked positions only (fairseq's boolean mask)."""
    masked_positions: bool = False
    """The same positions as flat indices: selecting them needs no device synchronisation."""
    has_padding: bool = False
    """A hint that spares the model finding out whether the batch holds padding."""

    @classmethod
    def of(cls, model: nn.Module, task: str) -> "ModelInputs":
        params = inspect.signature(model.forward).parameters
        masked_lm = TASK_RECORDS[task].predicts_masked_positions
        return cls(masked_tokens=masked_lm and "masked_tokens" in params,
                   masked_positions=masked_lm and "masked_positions" in params,
                   has_padding="has_padding" in params)


def summed_cross_entropy(model: nn.Module, batch: dict[str, torch.Tensor], inputs: "ModelInputs") -> torch.Tensor:
    """Summed cross-entropy (fp32) over ``batch``'s targets (``IGNORE_INDEX`` carries no loss).

    ``inputs`` says which of the batch's host-known facts the model takes: masked
    positions (a masked LM computing logits there only) and whether there is padding.
    Passed as indices and a flag, they cost the device no synchronisation.
    """
    targets = batch["targets"]
    kwargs = {}
    if inputs.has_padding and "has_padding" in batch:
        kwargs["has_padding"] = batch["has_padding"]
    if "document_ids" in batch:  # packed blocks with --document-mask (validation refuses models without it)
        kwargs["document_ids"] = batch["document_ids"]
    if inputs.masked_positions and "masked_positions" in batch:
        positions = batch["masked_positions"]
        logits = model(batch["input_ids"], masked_positions=positions, **kwargs)
        targets = targets.flatten().index_select(0, positions)
    elif inputs.masked_tokens:
        masked = targets.ne(IGNORE_INDEX)
        logits = model(batch["input_ids"], masked_tokens=masked, **kwargs)
        targets = targets[masked]
    else:
        logits = model(batch["input_ids"], **kwargs)
    return summed_token_loss(logits, targets)


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (fp32) of ``logits [..., V]`` against ``targets [...]``."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
