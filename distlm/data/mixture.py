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
validation loss is over all of the held-out data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from distlm.config import TrainConfig
from distlm.data.dictionary import Dictionary
from distlm.data.lm_dataset import LMData, SharedScan, load_lm_data, load_vocabulary
from distlm.errors import UsageError

# Keeps the draw of a source's samples apart from the sampler's shuffle and the masks.
_MIXTURE_STREAM = 0x4D49_5854


class MixtureData:
    """Samples of one split of several sources; build it with :func:`load_mixture`.

    ``sources``: each directory's samples (one vocabulary); ``names``: their directories;
    ``weights``: their weights (any scale; the split's shares follow them). ``shuffle``:
    draw each source's samples in a seeded order per epoch (False: in file order).
    """

    def __init__(self, sources: Sequence[LMData], names: Sequence[str], weights: Sequence[float], seed: int,
                 shuffle: bool = True) -> None:
        self.sources, self.names, self.seed, self.shuffle = list(sources), list(names), seed, shuffle
        total = float(sum(weights))
        self.weights = [weight / total for weight in weights]
        first = self.sources[0]
        self.dictionary, self.tokenizer_dir = first.dictionary, first.tokenizer_dir
        self.task, self.tokens_per_sample, self.fixed_masks = first.task, first.tokens_per_sample, first.fixed_masks
        self.sizes = [len(source) for source in self.sources]
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
            if len(self._orders) >= 4 * len(self.sources):
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = np.random.default_rng([_MIXTURE_STREAM, self.seed, *key]).permutation(size)
        return source, int(self._orders[key][draw % size])

    def sample(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, targets)`` of one sample, as :meth:`LMData.sample`."""
        source, inner = self.locate(epoch, index)
        return self.sources[source].sample(epoch, inner)

    collate = LMData.collate  # needs only ``sample`` and ``dictionary``

    def check_symbols(self, symbols: Sequence[str]) -> None:
        """UsageError unless ``symbols`` (a checkpoint's) are the sources' vocabulary."""
        self.sources[0].check_symbols(symbols)

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


def load_mixture(config: TrainConfig, sources: Sequence[tuple[float, str]], split: str, task: str,
                 symbols: Sequence[str] | None, scan: SharedScan | None = None) -> MixtureData:
    """Split ``split`` of each ``(weight, directory)`` source as the run's settings read it,
    refusing sources whose vocabularies differ."""
    settings = config.data
    directories = [directory for _, directory in sources]
    vocabularies = [load_vocabulary(directory, task) for directory in directories]
    for directory, vocabulary in zip(directories[1:], vocabularies[1:]):
        if vocabulary.symbols != vocabularies[0].symbols:
            raise UsageError(
                f"--data sources {directories[0]} and {directory} have different vocabularies "
                f"({_vocabulary_file(directories[0], vocabularies[0])} vs {_vocabulary_file(directory, vocabulary)}); "
                f"a mixture needs one: prepare every source with the same dictionary or tokenizer"
            )
    parts = [
        load_lm_data(directory, split=split, task=task, tokens_per_sample=settings.tokens_per_sample,
                     sample_break_mode=settings.sample_break_mode, seed=config.seed, mask_prob=settings.mask_prob,
                     symbols=symbols, mask_special_tokens=settings.mask_special_tokens, scan=scan)
        for directory in directories
    ]
    training = split == "train"
    weights = [weight for weight, _ in sources] if training else [len(part) for part in parts]
    return MixtureData(parts, directories, weights, config.seed, shuffle=training)


def _vocabulary_file(directory: str, vocabulary: object) -> str:
    name = "dict.txt" if isinstance(vocabulary, Dictionary) else "tokenizer.json"
    return f"{Path(directory) / name}: {len(vocabulary)} symbols"  # type: ignore[arg-type]
