"""Which samples each data-parallel rank trains on, as a pure function of one counter.

The training stream is an endless sequence of positions ``p = 0, 1, 2, ...``. Position
``p`` is sample ``perm(p // N)[p % N]`` of epoch ``p // N``, where ``perm(epoch)`` is a
permutation seeded by ``(seed, epoch)``. A global batch is the next
``global_batch_size`` positions after the samples consumed so far. A checkpoint then
only needs ``consumed_samples`` to resume at exactly the next batch, on any world size
or micro-batch split that keeps the global batch size. A global batch may straddle two
epochs, so nothing depends on the batch size dividing N.
"""

from __future__ import annotations

import numpy as np

from distlm.errors import UsageError

Sample = tuple[int, int]  # (epoch, sample index)

# Keeps the shuffling stream apart from the masking stream, which is seeded with
# (seed, epoch, index).
_SHUFFLE_STREAM = 0x5348_5546


class GlobalBatchSampler:
    """This rank's micro-batches of ``(epoch, sample_index)`` for a given stream position."""

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        update_freq: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if num_samples < 1:
            raise UsageError(f"the dataset has {num_samples} samples; it needs at least one (check the data split)")
        for name, value in (("micro_batch_size", micro_batch_size), ("update_freq", update_freq), ("dp_size", dp_size)):
            if value < 1:
                raise UsageError(f"{name} {value} must be at least 1")
        if not 0 <= dp_rank < dp_size:
            raise UsageError(f"dp_rank {dp_rank} must be in [0, {dp_size})")
        if seed < 0:
            raise UsageError(f"seed {seed} must be a non-negative integer")
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.update_freq = update_freq
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.update_freq * self.dp_size

    @property
    def local_batch_size(self) -> int:
        """Samples this rank consumes per update (all of its micro-batches)."""
        return self.micro_batch_size * self.update_freq

    def epoch_of(self, consumed_samples: int) -> int:
        """0-based epoch of the next sample after ``consumed_samples``."""
        return consumed_samples // self.num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """Sample order of ``epoch`` (the identity when not shuffling)."""
        if epoch not in self._permutations:
            if self.shuffle:
                order = np.random.default_rng([_SHUFFLE_STREAM, self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            # A global batch touches at most two epochs (it can span more only when it is
            # larger than the dataset), so a tiny cache saves recomputing permutations.
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = order
        return self._permutations[epoch]

    def samples_at(self, positions: np.ndarray) -> list[Sample]:
        """``(epoch, sample_index)`` of each global stream position."""
        epochs = positions // self.num_samples
        offsets = positions % self.num_samples
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            indices[in_epoch] = self.permutation(int(epoch))[offsets[in_epoch]]
        return list(zip(epochs.tolist(), indices.tolist()))

    def local_micro_batches(self, consumed_samples: int) -> list[list[Sample]]:
        """This rank's ``update_freq`` micro-batches for the global batch after ``consumed_samples``.

        Rank r takes the contiguous slice ``[r * B * U, (r + 1) * B * U)`` of the global
        batch and splits it in order into U micro-batches of B.
        """
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples {consumed_samples} must be non-negative")
        first = consumed_samples + self.dp_rank * self.local_batch_size
        samples = self.samples_at(np.arange(first, first + self.local_batch_size, dtype=np.int64))
        size = self.micro_batch_size
        return [samples[i : i + size] for i in range(0, len(samples), size)]
