"""RoBERTa's dynamic masking, drawn afresh for every sample in every epoch.

The random draws for a sample depend only on ``(seed, epoch, sample index)``. They never
depend on the rank, the world size or the batch it lands in, so a run produces the same
masks on 1 rank or 64 and after resuming from a checkpoint. Validation data passes one
fixed epoch (see ``LMData``), so its masks never change.

Two rules choose which positions are predicted:

- ``mask_special_tokens=True`` (the default) is fairseq's ``MaskTokensDataset``: the 15 %
  are drawn from every position of the sample, ``<s>`` and ``</s>`` included, in the same
  order of random draws as fairseq (a probabilistic count, positions, then two uniform
  draws per position for the 80/10/10 split, then the replacement tokens).
- ``mask_special_tokens=False`` is distlm's earlier rule: special tokens are never chosen,
  and random replacements are never special tokens.

``benchmarks/fairseq_masking.py`` checks the first rule against fairseq's own
``MaskTokensDataset``: given the generator fairseq seeds for a sample, the masks are the
same bit for bit. The choice matters. One job (RoBERTa of 2 layers, 128 wide; batch 8 x
128 tokens; lr 5e-4; 300 updates; the same fairseq-preprocess data; measured when the rule
was chosen) gave these training losses in bits at updates 50, 100, ..., 300:

============================  =====  =====  =====  =====  =====  =====
fairseq                       12.57  10.35  10.04   9.86   9.87   9.78
distlm, earlier rule          12.86  11.04  10.77  10.81  10.60  10.60
distlm, fairseq's rule        12.50  10.28  10.06   9.96   9.90   9.78
============================  =====  =====  =====  =====  =====  =====

Patching in fairseq's rule alone brought distlm's curve to within 0.1 bit of fairseq's at
every point; the earlier rule's losses are not comparable with fairseq's.
"""

from __future__ import annotations

import numpy as np

from distlm.config import check_shared_settings
from distlm.data.dictionary import Vocabulary
from distlm.errors import UsageError

IGNORE_INDEX = -100  # targets with this value carry no loss (torch's cross_entropy default)


class DynamicMasker:
    """Chooses ``mask_prob`` of a sample's positions as prediction targets.

    Of the chosen positions, 80 % become ``<mask>``, ``random_token_prob`` (10 %) become a
    random token, and ``leave_unmasked_prob`` (10 %) stay as they are (fairseq's
    ``MaskTokensDataset`` defaults). The target at every chosen position is its original
    token; everywhere else it is ``IGNORE_INDEX``.

    With ``mask_special_tokens=True`` (fairseq's rule), exactly as fairseq does:

    - every position can be chosen, ``<s>``, ``</s>`` and ``<unk>`` included; padding is
      added after masking, so it is never chosen (a pad token inside the data could be,
      and then carries no loss, as fairseq's criterion ignores pad targets);
    - the count is ``int(mask_prob * length + u)`` with ``u`` uniform in [0, 1): rounded up
      with probability equal to the fractional part, so its mean is exactly
      ``mask_prob * length``;
    - each chosen position becomes a random-or-unchanged candidate with probability
      ``random_token_prob + leave_unmasked_prob``, and a candidate stays unchanged with
      probability ``leave_unmasked_prob / (random_token_prob + leave_unmasked_prob)``;
    - random tokens are drawn uniformly from the whole vocabulary except the special
      tokens other than ``<mask>``: for a ``dict.txt`` vocabulary ``<s>``, ``<pad>``,
      ``</s>``, ``<unk>``, the first ``nspecial`` symbols, whose weights fairseq zeroes. So
      ``<mask>`` and ordinary extra symbols (fairseq's ``madeupword`` padding) can be drawn.

    With ``mask_special_tokens=False``, only positions holding non-special tokens can be
    chosen, the 80/10/10 split is one uniform draw per chosen position, and random tokens
    exclude every special token and ``<mask>``.
    """

    def __init__(
        self,
        dictionary: Vocabulary,
        seed: int,
        mask_prob: float = 0.15,
        random_token_prob: float = 0.1,
        leave_unmasked_prob: float = 0.1,
        mask_special_tokens: bool = True,
    ) -> None:
        if not 0.0 < mask_prob < 1.0:
            raise UsageError(f"mask_prob {mask_prob} must be between 0 and 1 (RoBERTa uses 0.15)")
        if random_token_prob < 0 or leave_unmasked_prob < 0 or random_token_prob + leave_unmasked_prob > 1.0:
            raise UsageError(
                f"random_token_prob {random_token_prob} and leave_unmasked_prob {leave_unmasked_prob} "
                f"must be non-negative and sum to at most 1"
            )
        check_shared_settings({"seed": seed})  # within --seed's bounds (distlm.config)
        self.seed = seed
        self.mask_prob = mask_prob
        self.random_token_prob = random_token_prob
        self.leave_unmasked_prob = leave_unmasked_prob
        self.mask_special_tokens = mask_special_tokens
        self.mask_index = dictionary.mask()
        self.pad_index = dictionary.pad()
        self.is_special = np.zeros(len(dictionary), dtype=bool)
        self.is_special[dictionary.special_indices()] = True
        in_pool = ~self.is_special
        if mask_special_tokens:
            in_pool[self.mask_index] = True
        self.replacement_pool = np.flatnonzero(in_pool)
        # fairseq draws replacements with rng.choice(V, n, p=weights), which numpy computes
        # as a search of n uniform draws in the weights' cumulative sum. Keeping that sum
        # gives the same tokens from the same generator without its O(V) work per sample.
        cdf = np.cumsum(in_pool / in_pool.sum())
        self._replacement_cdf = cdf / cdf[-1]

    def __call__(self, tokens: np.ndarray, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(inputs, targets)`` for one sample; targets are ``IGNORE_INDEX`` where nothing is predicted."""
        rng = np.random.default_rng([self.seed, epoch, index])
        if self.mask_special_tokens:
            return self.mask_every_position(tokens, rng)
        return self.mask_non_special_tokens(tokens, rng)

    def mask_every_position(self, tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """fairseq's rule, with fairseq's sequence of calls on ``rng``."""
        size = len(tokens)
        chosen = np.zeros(size, dtype=bool)
        num_chosen = int(self.mask_prob * size + rng.random())
        chosen[rng.choice(size, num_chosen, replace=False)] = True

        unchanged = randomized = np.zeros(size, dtype=bool)
        rand_or_unmask_prob = self.random_token_prob + self.leave_unmasked_prob
        if rand_or_unmask_prob > 0.0:
            rand_or_unmask = chosen & (rng.random(size) < rand_or_unmask_prob)
            if self.random_token_prob == 0.0:
                unchanged = rand_or_unmask
            elif self.leave_unmasked_prob == 0.0:
                randomized = rand_or_unmask
            else:
                decision = rng.random(size) < self.leave_unmasked_prob / rand_or_unmask_prob
                unchanged = rand_or_unmask & decision
                randomized = rand_or_unmask & ~decision

        inputs = tokens.copy()
        inputs[chosen & ~unchanged & ~randomized] = self.mask_index
        num_random = int(randomized.sum())
        if num_random > 0:
            inputs[randomized] = np.searchsorted(self._replacement_cdf, rng.random(num_random), side="right")
        targets = np.full_like(tokens, IGNORE_INDEX)
        predicted = chosen & (tokens != self.pad_index)
        targets[predicted] = tokens[predicted]
        return inputs, targets

    def mask_non_special_tokens(self, tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """distlm's earlier rule: special tokens are never chosen nor drawn as replacements."""
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
