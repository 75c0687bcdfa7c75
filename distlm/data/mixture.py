"""Several data directories with one vocabulary, mixed by weight into one dataset.

``--data 0.3:A 0.7:B``: one epoch of the mixture holds as many samples as its sources
together (N). Source s gets ``c_s`` of them, its weight's share of N (largest remainders,
so the counts sum to N), spread evenly through the epoch: its k-th sample is at
``(k + 1/2) / c_s`` of the way, ties going to the earlier source. Mixture index i is
therefore the k-th draw of one source, a function of i alone, and even an unshuffled
prefix of the epoch holds each source in its share. Which of the source's samples the
k-th draw is depends only on ``(seed, epoch, source)``: a source drawn more often than it
has samples is walked through in whole permutations, one drawn less often sees another
subset each epoch. The :class:`~distlm.data.sampler.GlobalBatchSampler` shuffles mixture
indices as it does one directory's samples, so the global sample sequence stays a pure
function of the consumed-sample count: the same on any world size, and resumed exactly
from that one count.

Every split but ``train`` mixes its sources by their sizes (each sample once), so a
validation loss is over all of the held-out data. The samples themselves are
``distlm.data.lm_dataset.MixtureData``'s, which this index picks among.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

# Keeps the draw of a source's samples apart from the sampler's shuffle and the masks.
_MIXTURE_STREAM = 0x4D49_5854


class MixtureIndex:
    """Which source, and which of its samples, each index of a mixture's epoch is.

    ``sizes``: each source's samples; ``weights``: their weights (any scale, not all 0);
    ``names``: their directories, for the log. ``shuffle``: draw each source's samples in
    a seeded order per epoch (False: in file order).
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], names: Sequence[str], seed: int,
                 shuffle: bool = True) -> None:
        total = float(sum(weights))
        self.sizes, self.names, self.seed, self.shuffle = list(sizes), list(names), seed, shuffle
        self.weights = [weight / total for weight in weights]
        self.counts = apportion(sum(self.sizes), self.weights)
        self.source_of, self.draw_of = interleave(self.counts)
        self._orders: dict[tuple[int, int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.source_of)

    def locate(self, epoch: int, index: int) -> tuple[int, int]:
        """``(source, sample index in that source)`` of mixture sample ``index`` in ``epoch``."""
        source, draw = int(self.source_of[index]), int(self.draw_of[index])
        size = self.sizes[source]
        if not self.shuffle:
            return source, draw % size
        key = (source, epoch, draw // size)
        if key not in self._orders:
            # A global batch touches at most two epochs, so a few orders per source suffice.
            if len(self._orders) >= 4 * len(self.sizes):
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = np.random.default_rng([_MIXTURE_STREAM, self.seed, *key]).permutation(size)
        return source, int(self._orders[key][draw % size])

    def locate_all(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`locate` of every index of ``epoch`` at once: each index's source, and its sample there."""
        inner = np.empty(len(self), dtype=np.int64)
        for source, size in enumerate(self.sizes):
            at = np.flatnonzero(self.source_of == source)
            draws = self.draw_of[at]
            if not self.shuffle:
                inner[at] = draws % size
                continue
            cycles = draws // size
            for cycle in np.unique(cycles):
                drawn = cycles == cycle
                order = np.random.default_rng([_MIXTURE_STREAM, self.seed, source, epoch, int(cycle)]).permutation(size)
                inner[at[drawn]] = order[draws[drawn] % size]
        return self.source_of.astype(np.int64), inner

    def drawn(self, consumed: int, permutation: Callable[[int], np.ndarray]) -> list[int]:
        """Samples of each source among the stream's first ``consumed`` positions, where
        ``permutation(epoch)`` is the order the sampler reads the epoch's indices in."""
        epochs, offset = divmod(consumed, len(self))
        partial = np.bincount(self.source_of[permutation(epochs)[:offset]], minlength=len(self.counts))
        return [epochs * count + int(extra) for count, extra in zip(self.counts, partial)]

    def labels(self) -> list[str]:
        """A short name per source for its validation lines: its directory's name, led by its
        position when two directories share a name."""
        names = [Path(name).name or name for name in self.names]
        if len(set(names)) < len(names):
            names = [f"{position}-{name}" for position, name in enumerate(names)]
        return names

    def describe_sources(self) -> list[str]:
        """One line per source: its weight, its share of an epoch and its size."""
        epoch = len(self)
        return [f"{name}: weight {weight:.4g}, {count} of each epoch's {epoch} samples "
                f"({100 * count / epoch:.1f}%), {size} samples in the directory"
                for name, weight, count, size in zip(self.names, self.weights, self.counts, self.sizes)]


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (summing to 1) by largest remainders."""
    exact = np.asarray(weights, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    # Stable: equal remainders go to the earlier source.
    for source in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
        counts[source] += 1
    return counts.tolist()


def interleave(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(source, draw)`` of each position of an epoch: source s's k-th draw at ``(k + 1/2) / c_s``."""
    times = np.concatenate([(np.arange(count) + 0.5) / count for count in counts if count > 0])
    sources = np.concatenate([np.full(count, source, dtype=np.int32) for source, count in enumerate(counts)])
    draws = np.concatenate([np.arange(count, dtype=np.int64) for count in counts])
    order = np.argsort(times, kind="stable")  # sources are concatenated in order: ties go to the earlier
    return sources[order], draws[order]
