"""Cut a dataset of sentences into training blocks, with fairseq's ``--sample-break-mode``.

Blocks are ranges ``[start, start + length)`` of the concatenated token stream, computed
once with numpy when the dataset is opened. Reading a block then touches only the
sentences it overlaps.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from distlm.choices import SAMPLE_BREAK_MODES
from distlm.errors import UsageError


class SentenceDataset(Protocol):
    sizes: np.ndarray

    def get_slice(self, index: int, offset: int, length: int) -> np.ndarray: ...


def compute_block_boundaries(
    sizes: np.ndarray,
    block_size: int,
    break_mode: str,
    min_length: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Block ``(starts, lengths)`` in the concatenated token stream of sentences of ``sizes``.

    - ``none``: fixed ``block_size`` pieces that ignore sentence boundaries (last may be short).
    - ``complete``: greedily pack whole sentences while the total stays <= ``block_size``.
      A sentence longer than ``block_size`` becomes its own block *truncated* to
      ``block_size``. fairseq keeps it whole, but then a sample could exceed the model's
      context length, so here the tail is dropped.
    - ``eos``: one sentence per block, truncated to ``block_size``.

    Blocks shorter than ``min_length`` are dropped (a causal sample needs two tokens).
    """
    if break_mode not in SAMPLE_BREAK_MODES:
        raise UsageError(f"sample_break_mode {break_mode!r} is not one of {', '.join(SAMPLE_BREAK_MODES)}")
    if block_size < 1:
        raise UsageError(f"block size {block_size} must be at least 1; raise tokens_per_sample")
    sizes = np.asarray(sizes, dtype=np.int64)
    sentence_starts = np.concatenate([[0], np.cumsum(sizes)])
    total = int(sentence_starts[-1])

    if break_mode == "none":
        starts = np.arange(0, total, block_size, dtype=np.int64)
        lengths = np.minimum(block_size, total - starts)
    elif break_mode == "eos":
        starts = sentence_starts[:-1]
        lengths = np.minimum(sizes, block_size)
    else:
        starts, lengths = _pack_complete_sentences(sentence_starts, block_size)

    keep = lengths >= min_length
    return starts[keep], lengths[keep]


def _pack_complete_sentences(sentence_starts: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    num_sentences = len(sentence_starts) - 1
    if num_sentences == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    # For every sentence j, the first sentence that no longer fits in a block starting at
    # j, all at once with searchsorted. At least j + 1, so an over-long sentence still
    # forms a block. The greedy packing then only follows these jumps, one Python step
    # per block rather than per sentence.
    next_start = np.searchsorted(sentence_starts, sentence_starts[:-1] + block_size, side="right") - 1
    next_start = np.maximum(next_start, np.arange(1, num_sentences + 1)).tolist()
    first_sentences = []
    sentence = 0
    while sentence < num_sentences:
        first_sentences.append(sentence)
        sentence = next_start[sentence]
    first = np.asarray(first_sentences, dtype=np.int64)
    ends = np.append(first[1:], num_sentences)
    starts = sentence_starts[first]
    lengths = np.minimum(sentence_starts[ends] - starts, block_size)
    return starts, lengths


class TokenBlockDataset:
    """Blocks of token ids over a sentence dataset (e.g. :class:`MMapIndexedDataset`)."""

    def __init__(
        self,
        dataset: SentenceDataset,
        block_size: int,
        break_mode: str = "complete",
        min_length: int = 1,
    ) -> None:
        self.dataset = dataset
        self.block_size = block_size
        self.break_mode = break_mode
        self._sentence_sizes = np.asarray(dataset.sizes, dtype=np.int64)
        self._sentence_starts = np.concatenate([[0], np.cumsum(self._sentence_sizes)])
        self.starts, self.sizes = compute_block_boundaries(self._sentence_sizes, block_size, break_mode, min_length)
        # side="right" - 1 skips empty sentences that share the block's start offset.
        self._first_sentence = np.searchsorted(self._sentence_starts, self.starts, side="right") - 1

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> np.ndarray:
        pieces = [self.dataset.get_slice(sentence, offset, take) for sentence, offset, take in self._spans(index)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def sentence_ids(self, index: int) -> np.ndarray:
        """The index of the sentence (document) each token of block ``index`` comes from."""
        return np.concatenate([np.full(take, sentence, dtype=np.int64) for sentence, _, take in self._spans(index)])

    def _spans(self, index: int) -> list[tuple[int, int, int]]:
        """``(sentence, offset, length)`` of each non-empty piece of block ``index``, in order."""
        sentence = int(self._first_sentence[index])
        offset = int(self.starts[index] - self._sentence_starts[sentence])
        remaining = int(self.sizes[index])
        spans = []
        while remaining > 0:
            take = min(int(self._sentence_sizes[sentence]) - offset, remaining)
            if take > 0:
                spans.append((sentence, offset, take))
                remaining -= take
            sentence += 1
            offset = 0
        return spans
