"""The training objective: summed cross-entropy over a batch's target tokens.

The sum, not the mean: the trainer divides once by the global number of target tokens
of the update, so every token weighs the same whatever rank or micro-batch holds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlm.data.masking import IGNORE_INDEX


def summed_cross_entropy(model: nn.Module, batch: dict[str, torch.Tensor], masked_tokens_only: bool) -> torch.Tensor:
    """Summed cross-entropy (fp32) over ``batch``'s targets (``IGNORE_INDEX`` carries no loss).

    ``masked_tokens_only``: the model computes logits at the targets' positions only
    (a masked LM's ``forward(input_ids, masked_tokens=...)``).
    """
    targets = batch["targets"]
    if masked_tokens_only:
        masked = targets.ne(IGNORE_INDEX)
        logits = model(batch["input_ids"], masked_tokens=masked)
        targets = targets[masked]
    else:
        logits = model(batch["input_ids"])
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
