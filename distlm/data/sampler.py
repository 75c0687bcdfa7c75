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

import bisect
from collections.abc import Callable

import numpy as np

from distlm.config import check_shared_settings
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
        check_shared_settings({"seed": seed})  # within --seed's bounds (distlm.config)
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

    def update_micro_batches(self, start: int, k: int) -> list[list[Sample]]:
        """This rank's micro-batches of the ``k``-th update after ``start`` consumed samples."""
        return self.local_micro_batches(start + k * self.global_batch_size)

    def samples_in_update(self, consumed_samples: int) -> int:
        """Samples of every rank in the update after ``consumed_samples``."""
        return self.global_batch_size

    def updates_in_epochs(self, epochs: int) -> int:
        """Updates that ``epochs`` passes over the data take (the schedule's length under --max-epoch)."""
        return -(-epochs * self.num_samples // self.global_batch_size)


def token_budget_bounds(sorted_sizes: np.ndarray, max_tokens: int, max_sentences: int, multiple: int) -> np.ndarray:
    """Start of each batch (and the end) over samples sorted by length, as fairseq's
    ``batch_by_size`` cuts them: a batch grows while its padded size (rows x longest)
    stays within ``max_tokens`` and its rows within ``max_sentences``; a full batch keeps the
    largest multiple of ``multiple`` rows (or all of them when fewer) and the rest start the next."""
    bounds, start = [0], 0
    for end in range(len(sorted_sizes)):
        rows = end - start
        # Sorted ascending, so the sample at ``end`` is the longest of the grown batch.
        if rows and ((rows + 1) * int(sorted_sizes[end]) > max_tokens or rows == max_sentences):
            keep = max(multiple * (rows // multiple), rows % multiple)
            start += keep
            bounds.append(start)
    bounds.append(len(sorted_sizes))
    return np.asarray(bounds, dtype=np.int64)


def token_budget_batches(sizes: np.ndarray, indices: np.ndarray, max_tokens: int, max_sentences: int,
                         multiple: int) -> list[np.ndarray]:
    """``indices`` in batches within the token budget, as :class:`TokenBudgetSampler` cuts an
    epoch but unshuffled: by length (ties in index order), for validation (``--max-tokens-valid``)."""
    order = indices[np.argsort(sizes[indices], kind="stable")]
    bounds = token_budget_bounds(sizes[order], max_tokens, max_sentences, multiple)
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


class TokenBudgetSampler:
    """``--max-tokens``: batches of samples of similar length within a token budget, as fairseq's.

    Each epoch sorts the samples by length (ties in an order seeded by ``(seed, epoch)``) and
    cuts them into batches at fixed places (:func:`token_budget_bounds`: the places depend on
    the lengths only, so every epoch of one dataset has the same number of batches), then
    shuffles the batches by ``(seed, epoch)``. The batches of all epochs form one stream, the
    same on every world size; an update takes its next ``update_freq x dp_size`` batches, and
    rank r trains on the r-th run of ``update_freq`` of them as its micro-batches. One process
    with ``--update-freq`` ``update_freq x dp_size`` trains on the same batches in the same order.

    The position is still ``consumed_samples``: the samples of the batches consumed. Within an
    epoch it names one batch of the shuffled order, so a run resumes exactly at any world size
    or ``--update-freq``; a count that falls inside a batch (one saved without --max-tokens or
    with other lengths) is refused in one line.

    ``epoch_sizes(epoch)``: the lengths of the samples in ``epoch``, where they change from epoch
    to epoch (a mixture, whose index i is another sample of its source each epoch); ``sizes`` then
    holds every length a sample can have, for the check against the budget. Each epoch is cut
    at its own places, so epochs may differ in their number of batches: the stream counts them.
    """

    def __init__(self, sizes: np.ndarray, max_tokens: int, max_sentences: int, multiple: int, update_freq: int,
                 dp_rank: int, dp_size: int, seed: int, skip_too_long: bool = False,
                 epoch_sizes: Callable[[int], np.ndarray] | None = None, num_samples: int | None = None) -> None:
        sizes = np.asarray(sizes, dtype=np.int64)
        too_long = sizes > max_tokens
        if too_long.any() and not skip_too_long:
            raise UsageError(
                f"{int(too_long.sum())} of the {len(sizes)} training samples are longer than --max-tokens {max_tokens} "
                f"(the longest has {int(sizes.max())} tokens): raise --max-tokens to at least {int(sizes.max())}, or "
                "skip them with --skip-invalid-size-inputs-valid-test"
            )
        if too_long.any() and epoch_sizes is not None:
            raise UsageError(
                f"{int(too_long.sum())} samples of the mixture's sources are longer than --max-tokens {max_tokens}, "
                "and a mixture cannot skip them (its epochs would change length): raise --max-tokens to at least "
                f"{int(sizes.max())}"
            )
        self.skipped = int(too_long.sum())
        """Samples left out for being longer than the budget (--skip-invalid-size-inputs-valid-test)."""
        self.epoch_sizes = epoch_sizes
        self.max_tokens, self.max_sentences, self.multiple = max_tokens, max_sentences, multiple
        if epoch_sizes is None:
            self.indices = np.flatnonzero(~too_long)
            if len(self.indices) == 0:
                raise UsageError(f"no training sample fits --max-tokens {max_tokens}; raise --max-tokens")
            self.sizes = sizes[self.indices]
            self.num_samples = len(self.indices)
            self.bounds = token_budget_bounds(np.sort(self.sizes, kind="stable"), max_tokens, max_sentences, multiple)
        else:
            self.num_samples = int(num_samples)
            self.indices = np.arange(self.num_samples)
        self.update_freq, self.dp_rank, self.dp_size, self.seed = update_freq, dp_rank, dp_size, seed
        self._epochs: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
        self._batches_before = [0]
        """Batches of the stream before each epoch, as far as they are known (epochs of their own lengths)."""
        self.num_batches = len(self.bounds) - 1 if epoch_sizes is None else len(self.batches(0)[0])
        """Batches per epoch (of the first epoch, where epochs differ)."""
        self.batches_per_update = update_freq * dp_size
        if self.batches_per_update > self.num_batches:
            raise UsageError(
                f"an update takes {self.batches_per_update} batches (--update-freq {update_freq} x {dp_size} "
                f"replicas) but --max-tokens {max_tokens} makes only {self.num_batches} of the {self.num_samples} "
                "training samples: lower --max-tokens or --update-freq, or use fewer ranks"
            )
        self._last_position = (-1, 0)

    def epoch_of(self, consumed_samples: int) -> int:
        """0-based epoch of the next sample after ``consumed_samples``."""
        return consumed_samples // self.num_samples

    def batches(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The sample indices of each batch of ``epoch`` in training order, and the samples
        consumed before each batch of it (one more entry: the epoch's total)."""
        if epoch not in self._epochs:
            rng = np.random.default_rng([_SHUFFLE_STREAM, self.seed, epoch])
            if self.epoch_sizes is None:
                sizes, bounds = self.sizes, self.bounds
            else:
                sizes = np.asarray(self.epoch_sizes(epoch), dtype=np.int64)
                bounds = token_budget_bounds(np.sort(sizes, kind="stable"), self.max_tokens, self.max_sentences,
                                             self.multiple)
            order = np.lexsort((rng.permutation(self.num_samples), sizes))  # by length, ties shuffled
            cut = [self.indices[order[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]
            shuffled = [cut[i] for i in rng.permutation(len(cut))]
            before = np.concatenate([[0], np.cumsum([len(batch) for batch in shuffled])])
            if len(self._epochs) >= 2:  # an update touches at most two epochs
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (shuffled, before)
        return self._epochs[epoch]

    def batches_in_epoch(self, epoch: int) -> int:
        return self.num_batches if self.epoch_sizes is None else len(self.batches(epoch)[0])

    def first_batch(self, epoch: int) -> int:
        """Batches of the stream before ``epoch``."""
        if self.epoch_sizes is None:
            return epoch * self.num_batches
        while len(self._batches_before) <= epoch:
            self._batches_before.append(self._batches_before[-1] + self.batches_in_epoch(len(self._batches_before) - 1))
        return self._batches_before[epoch]

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample indices of ``epoch`` in the order training reads them (a mixture's per-source
        counts of consumed samples follow it)."""
        return np.concatenate(self.batches(epoch)[0])

    def batch_position(self, consumed_samples: int) -> int:
        """Batches of the stream consumed after ``consumed_samples`` samples."""
        if self._last_position[0] == consumed_samples:  # an iterator asks for its start at every update
            return self._last_position[1]
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples {consumed_samples} must be non-negative")
        epoch, offset = divmod(consumed_samples, self.num_samples)
        before = self.batches(epoch)[1]
        k = int(np.searchsorted(before, offset))
        if before[k] != offset:
            raise UsageError(
                f"the data position, {consumed_samples} samples consumed, falls inside a --max-tokens batch (the "
                "checkpoint was saved with other batching or other data); resume with the batching it was saved with"
            )
        self._last_position = (consumed_samples, self.first_batch(epoch) + k)
        return self._last_position[1]

    def _batch(self, position: int) -> list[Sample]:
        if self.epoch_sizes is None:
            epoch, k = divmod(position, self.num_batches)
        else:
            epoch = bisect.bisect_right(self._batches_before, position) - 1
            while self.first_batch(epoch + 1) <= position:
                epoch += 1
            k = position - self.first_batch(epoch)
        return [(epoch, int(index)) for index in self.batches(epoch)[0][k]]

    def update_micro_batches(self, start: int, k: int) -> list[list[Sample]]:
        """This rank's micro-batches of the ``k``-th update after ``start`` consumed samples."""
        first = self.batch_position(start) + k * self.batches_per_update + self.dp_rank * self.update_freq
        return [self._batch(position) for position in range(first, first + self.update_freq)]

    def samples_in_update(self, consumed_samples: int) -> int:
        """Samples of every rank in the update after ``consumed_samples``."""
        first = self.batch_position(consumed_samples)
        return sum(len(self._batch(position)) for position in range(first, first + self.batches_per_update))

    def updates_in_epochs(self, epochs: int) -> int:
        """Updates that ``epochs`` passes over the data take (the schedule's length under --max-epoch)."""
        return -(-self.first_batch(epochs) // self.batches_per_update)
