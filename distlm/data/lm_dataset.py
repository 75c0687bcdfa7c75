"""Language-model samples from a ``fairseq-preprocess`` directory (or the built-in corpus).

``load_lm_data`` opens one split and cuts it into blocks. ``collate`` turns a list of
``(epoch, sample_index)`` pairs, as produced by :class:`GlobalBatchSampler`, into padded
tensors. Masking is drawn per sample from ``(seed, epoch, index)`` only, so a sample's
tensors do not depend on the batch or rank that holds it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from distlm.data.blocks import BREAK_MODES, TokenBlockDataset
from distlm.data.dictionary import MASK_SYMBOL, Dictionary
from distlm.data.indexed_dataset import MMapIndexedDataset
from distlm.data.masking import IGNORE_INDEX, DynamicMasker
from distlm.errors import UsageError

TASKS = ("masked_lm", "causal_lm")
_EXPECTED_LAYOUT = "a fairseq-preprocess output directory (dict.txt, train.bin/.idx, valid.bin/.idx)"


class LMData:
    """Samples of one split for one task; build it with :func:`load_lm_data`."""

    def __init__(
        self,
        tokens: MMapIndexedDataset,
        dictionary: Dictionary,
        task: str,
        tokens_per_sample: int,
        sample_break_mode: str,
        seed: int,
        mask_prob: float,
    ) -> None:
        self.tokens = tokens
        self.dictionary = dictionary
        self.task = task
        self.tokens_per_sample = tokens_per_sample
        if task == "masked_lm":
            # One slot is kept for the <s> that starts every sample (fairseq masked_lm).
            self.blocks = TokenBlockDataset(tokens, tokens_per_sample - 1, sample_break_mode)
            self.masker: DynamicMasker | None = DynamicMasker(dictionary, seed, mask_prob)
        else:
            # Megatron's convention: tokens_per_sample + 1 tokens give tokens_per_sample
            # inputs, each with its next token as target. Unlike Megatron's, blocks do not
            # overlap by a token, so the first token of each block is never a target; the
            # simpler block layout is worth that 1/tokens_per_sample. One token alone has
            # no target, hence min_length=2.
            self.blocks = TokenBlockDataset(tokens, tokens_per_sample + 1, sample_break_mode, min_length=2)
            self.masker = None

    def __len__(self) -> int:
        return len(self.blocks)

    def sample(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, targets)`` of one sample as int64 arrays of equal length."""
        block = self.blocks[index]
        outside = (block < 0) | (block >= len(self.dictionary))
        if outside.any():
            raise UsageError(
                f"data {self.tokens.prefix} holds token id {int(block[outside][0])} outside the dictionary's "
                f"{len(self.dictionary)} symbols; dict.txt and the .bin files do not belong together"
            )
        if self.masker is not None:
            return self.masker(np.concatenate([[self.dictionary.bos()], block]), epoch, index)
        return block[:-1], block[1:]

    def collate(self, pairs: Sequence[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Padded ``input_ids`` and ``targets`` ([B, T], T = longest sample) and ``ntokens``."""
        if not pairs:
            raise ValueError("collate needs at least one (epoch, sample_index) pair")
        samples = [self.sample(epoch, index) for epoch, index in pairs]
        width = max(len(inputs) for inputs, _ in samples)
        input_ids = np.full((len(samples), width), self.dictionary.pad(), dtype=np.int64)
        targets = np.full((len(samples), width), IGNORE_INDEX, dtype=np.int64)
        for row, (inputs, sample_targets) in enumerate(samples):
            input_ids[row, : len(inputs)] = inputs
            targets[row, : len(sample_targets)] = sample_targets
        targets_tensor = torch.from_numpy(targets)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "targets": targets_tensor,
            "ntokens": (targets_tensor != IGNORE_INDEX).sum(),
        }


def load_lm_data(
    path: str | os.PathLike | None,
    split: str,
    task: str,
    tokens_per_sample: int,
    sample_break_mode: str = "complete",
    seed: int = 1,
    mask_prob: float = 0.15,
    dictionary: Dictionary | None = None,
) -> LMData:
    """Open ``split`` of a fairseq-preprocess directory (``path=None``: the built-in corpus).

    ``dictionary`` (e.g. rebuilt from a checkpoint) replaces the directory's own, and
    must agree with it symbol for symbol.
    """
    if task not in TASKS:
        raise UsageError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if sample_break_mode not in BREAK_MODES:
        raise UsageError(f"sample_break_mode {sample_break_mode!r} is not one of {', '.join(BREAK_MODES)}")
    minimum = 2 if task == "masked_lm" else 1
    if tokens_per_sample < minimum:
        raise UsageError(f"tokens_per_sample {tokens_per_sample} must be at least {minimum} for {task}")
    if seed < 0:
        raise UsageError(f"seed {seed} must be a non-negative integer")

    if path is None:
        # Imported here so that `python -m distlm.data.corpus` does not find its own module
        # already imported through the package (runpy warns about that).
        from distlm.data.corpus import ensure_builtin_corpus

        directory = ensure_builtin_corpus()
    else:
        directory = Path(path)
    if not directory.is_dir():
        raise UsageError(f"data path {directory} is not a directory; expected {_EXPECTED_LAYOUT}")
    dict_path = directory / "dict.txt"
    if not dict_path.is_file():
        raise UsageError(f"data path {directory} has no dict.txt; expected {_EXPECTED_LAYOUT}")
    if not (directory / f"{split}.idx").is_file():
        raise UsageError(
            f"data path {directory} has no {split}.idx/.bin for split {split!r}; expected {_EXPECTED_LAYOUT}"
        )

    data_dictionary = Dictionary.load(dict_path)
    if task == "masked_lm":
        data_dictionary.add_symbol(MASK_SYMBOL)
    if dictionary is not None:
        if len(dictionary) != len(data_dictionary):
            raise UsageError(
                f"the given dictionary has {len(dictionary)} symbols but {dict_path} gives {len(data_dictionary)} "
                f"for {task}; resume with the data the checkpoint was trained on"
            )
        if dictionary.symbols != data_dictionary.symbols:
            first = next(i for i, (a, b) in enumerate(zip(dictionary.symbols, data_dictionary.symbols)) if a != b)
            raise UsageError(
                f"the given dictionary differs from {dict_path} at index {first} "
                f"({dictionary.symbols[first]!r} vs {data_dictionary.symbols[first]!r}); "
                f"resume with the data the checkpoint was trained on"
            )
        data_dictionary = dictionary

    tokens = MMapIndexedDataset(directory / split)
    data = LMData(tokens, data_dictionary, task, tokens_per_sample, sample_break_mode, seed, mask_prob)
    if len(data) == 0:
        raise UsageError(f"split {split!r} of data path {directory} holds no {task} samples; it is empty")
    return data
