"""RoBERTa's dynamic masking, drawn afresh for every sample in every epoch.

The random draws for a sample depend only on ``(seed, epoch, sample index)``. They never
depend on the rank, the world size or the batch it lands in, so a run produces the same
masks on 1 rank or 64 and after resuming from a checkpoint.
"""

from __future__ import annotations

import numpy as np

from distlm.data.dictionary import Dictionary
from distlm.errors import UsageError

IGNORE_INDEX = -100  # targets with this value carry no loss (torch's cross_entropy default)


class DynamicMasker:
    """Chooses ``mask_prob`` of a sample's non-special tokens as prediction targets.

    Of the chosen tokens, 80 % become ``<mask>``, ``random_token_prob`` (10 %) become a
    uniformly random non-special token, and ``leave_unmasked_prob`` (10 %) stay as they
    are (fairseq's ``MaskTokensDataset`` defaults).
    """

    def __init__(
        self,
        dictionary: Dictionary,
        seed: int,
        mask_prob: float = 0.15,
        random_token_prob: float = 0.1,
        leave_unmasked_prob: float = 0.1,
    ) -> None:
        if not 0.0 < mask_prob < 1.0:
            raise UsageError(f"mask_prob {mask_prob} must be between 0 and 1 (RoBERTa uses 0.15)")
        if random_token_prob < 0 or leave_unmasked_prob < 0 or random_token_prob + leave_unmasked_prob > 1.0:
            raise UsageError(
                f"random_token_prob {random_token_prob} and leave_unmasked_prob {leave_unmasked_prob} "
                f"must be non-negative and sum to at most 1"
            )
        if seed < 0:
            raise UsageError(f"seed {seed} must be a non-negative integer")
        self.seed = seed
        self.mask_prob = mask_prob
        self.random_token_prob = random_token_prob
        self.leave_unmasked_prob = leave_unmasked_prob
        self.mask_index = dictionary.mask()
        self.is_special = np.zeros(len(dictionary), dtype=bool)
        self.is_special[dictionary.special_indices()] = True
        self.replacement_pool = np.flatnonzero(~self.is_special)

    def __call__(self, tokens: np.ndarray, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(inputs, targets)`` for one sample; targets are ``IGNORE_INDEX`` where nothing is predicted."""
        rng = np.random.default_rng([self.seed, epoch, index])
        candidates = np.flatnonzero(~self.is_special[tokens])
        # fairseq's probabilistic rounding: the expected count is exactly mask_prob * n,
        # even for short samples where plain rounding would bias it.
        num_chosen = min(int(self.mask_prob * len(candidates) + rng.random()), len(candidates))
        chosen = rng.choice(candidates, size=num_chosen, replace=False)

        inputs = tokens.copy()
        targets = np.full_like(tokens, IGNORE_INDEX)
        targets[chosen] = tokens[chosen]

        decision = rng.random(num_chosen)
        mask_threshold = 1.0 - self.random_token_prob - self.leave_unmasked_prob
        to_mask = chosen[decision < mask_threshold]
        to_randomize = chosen[(decision >= mask_threshold) & (decision < mask_threshold + self.random_token_prob)]
        inputs[to_mask] = self.mask_index
        inputs[to_randomize] = rng.choice(self.replacement_pool, size=len(to_randomize))
        return inputs, targets
