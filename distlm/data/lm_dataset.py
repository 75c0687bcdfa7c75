"""Language-model samples from a data directory (or the built-in corpus).

A data directory is either ``fairseq-preprocess`` output (``dict.txt``) or
``python -m distlm.data.prepare`` output (a Hugging Face ``tokenizer.json`` and no
``dict.txt``), with ``train.bin/.idx`` and ``valid.bin/.idx`` in fairseq's or Megatron's
layout.

``load_lm_data`` opens one split and cuts it into blocks. ``collate`` turns a list of
``(epoch, sample_index)`` pairs, as produced by :class:`GlobalBatchSampler`, into padded
tensors. Masking is drawn per sample from ``(seed, epoch, index)`` only, so a sample's
tensors do not depend on the batch or rank that holds it. Every split but ``train`` has
fixed masks, drawn as for epoch 0 whatever epoch is asked for (fairseq always validates
with epoch 1), so validation losses compare across epochs and runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distlm.choices import SAMPLE_BREAK_MODES, TASKS
from distlm.config import TrainConfig, check_shared_settings, parse_data_sources
from distlm.data.blocks import TokenBlockDataset
from distlm.data.corpus import ensure_builtin_corpus
from distlm.data.dictionary import MASK_SYMBOL, Dictionary, Vocabulary
from distlm.data.hf_tokenizer import HFVocabulary, is_hf_tokenizer_dir
from distlm.data.indexed_dataset import MMapIndexedDataset
from distlm.data.masking import IGNORE_INDEX, DynamicMasker
from distlm.data.mixture import MixtureIndex
from distlm.errors import UsageError

_EXPECTED_LAYOUT = (
    "a fairseq-preprocess output directory (dict.txt, train.bin/.idx, valid.bin/.idx) "
    "or a python -m distlm.data.prepare one (tokenizer.json, train.bin/.idx, valid.bin/.idx)"
)


@dataclass(frozen=True)
class SharedScan:
    """Ranks that share the load-time scan of a split for ids outside the vocabulary: this
    one reads part ``index`` of ``count``, and ``gather`` (a collective over all of them,
    results in index order) hands every rank every part's verdict, so each raises the same
    line having read 1/count of the file."""

    index: int
    count: int
    gather: Callable[[Any], list[Any]]


def first_id_outside(tokens: MMapIndexedDataset, size: int, scan: SharedScan | None) -> tuple[int, int] | None:
    """The file's first id outside ``[0, size)`` and its sequence (collective with ``scan``)."""
    if scan is None:
        return tokens.find_id_outside(0, size)
    found = scan.gather(tokens.find_id_outside(0, size, part=(scan.index, scan.count)))
    return next((verdict for verdict in found if verdict is not None), None)  # parts lie in file order


class LMData:
    """Samples of one split for one task; build it with :func:`load_lm_data`.

    ``dictionary`` is the vocabulary (a :class:`Dictionary` or an :class:`HFVocabulary`);
    ``tokenizer_dir`` is the Hugging Face tokenizer directory the data was made with, or
    None for ``dict.txt`` data. With ``fixed_masks`` every epoch gets epoch 0's masks.
    ``scan``: the ranks that share the check of the ids (None: this process reads it all).
    """

    def __init__(
        self,
        tokens: MMapIndexedDataset,
        dictionary: Vocabulary,
        task: str,
        tokens_per_sample: int,
        sample_break_mode: str,
        seed: int,
        mask_prob: float,
        mask_special_tokens: bool = True,
        fixed_masks: bool = False,
        scan: SharedScan | None = None,
        document_mask: bool = False,
    ) -> None:
        if document_mask and task != "causal_lm":
            raise UsageError(f"--document-mask is for causal_lm packing; {task} attends both ways, drop it")
        self.document_mask = document_mask
        self.tokens = tokens
        self.dictionary = dictionary
        self.task = task
        self.tokens_per_sample = tokens_per_sample
        self.fixed_masks = fixed_masks
        self.tokenizer_dir: Path | None = dictionary.tokenizer_dir if isinstance(dictionary, HFVocabulary) else None
        # All of the file, at load: a bad id met at a sample would stop only the rank (or the
        # data worker) that reads it, possibly hours in, while the other ranks wait for it.
        outside = first_id_outside(tokens, len(dictionary), scan)
        if outside is not None:
            raise UsageError(
                f"data {tokens.prefix} holds token id {outside[0]} (in sequence {outside[1]}) outside the dictionary's "
                f"{len(dictionary)} symbols; the vocabulary (dict.txt or tokenizer.json) and the .bin files "
                f"do not belong together"
            )
        if task == "masked_lm":
            # One slot is kept for the <s> that starts every sample (fairseq masked_lm).
            self.blocks = TokenBlockDataset(tokens, tokens_per_sample - 1, sample_break_mode)
            self.masker: DynamicMasker | None = DynamicMasker(
                dictionary, seed, mask_prob, mask_special_tokens=mask_special_tokens
            )
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

    @property
    def sizes(self) -> np.ndarray:
        """Input tokens of each sample, as :meth:`sample` makes it (``--max-tokens`` batches by them)."""
        return self.blocks.sizes + 1 if self.masker is not None else self.blocks.sizes - 1

    def check_symbols(self, symbols: Sequence[str]) -> None:
        """UsageError unless ``symbols`` (the list a checkpoint stores) are this data's vocabulary."""
        _check_same_symbols(list(symbols), self.dictionary, Path(self.tokens.prefix).parent, self.task)

    def sample(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, targets)`` of one sample as int64 arrays of equal length."""
        block = self.blocks[index]
        outside = (block < 0) | (block >= len(self.dictionary))
        if outside.any():
            raise UsageError(
                f"data {self.tokens.prefix} holds token id {int(block[outside][0])} outside the dictionary's "
                f"{len(self.dictionary)} symbols; the vocabulary (dict.txt or tokenizer.json) and the .bin files "
                f"do not belong together"
            )
        if self.masker is not None:
            mask_epoch = 0 if self.fixed_masks else epoch
            return self.masker(np.concatenate([[self.dictionary.bos()], block]), mask_epoch, index)
        if not self.document_mask:
            return block[:-1], block[1:]
        # A document's first token is no target: predicting it from the previous document
        # is what document masking removes.
        documents = self.blocks.sentence_ids(index)
        targets = np.where(documents[1:] != documents[:-1], IGNORE_INDEX, block[1:])
        return block[:-1], targets

    def collate(self, pairs: Sequence[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Padded ``input_ids`` and ``targets`` ([B, T], T = longest sample) and ``ntokens``;
        with document masking also ``document_ids`` (padding is a document of its own)."""
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
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "targets": targets_tensor,
            "ntokens": (targets_tensor != IGNORE_INDEX).sum(),
        }
        if self.document_mask:
            documents = np.full((len(samples), width), -1, dtype=np.int64)
            for row, (epoch, index) in enumerate(pairs):
                documents[row, : len(samples[row][0])] = self.document_ids(epoch, index)[:-1]
            batch["document_ids"] = torch.from_numpy(documents)
        return batch

    def document_ids(self, epoch: int, index: int) -> np.ndarray:
        """Which document each token of sample ``index`` belongs to (for document masking)."""
        return self.blocks.sentence_ids(index)


def load_split(config: TrainConfig, split: str, task: str, symbols: Sequence[str] | None,
               scan: SharedScan | None = None) -> LMData | MixtureData:
    """Split ``split`` of ``--data`` (the built-in corpus by default, or a weighted mixture of
    directories) as the run's settings read it; ``symbols`` from a checkpoint must agree
    with its vocabulary."""
    settings = config.data
    sources = parse_data_sources(settings.data)
    if sources is not None:
        return load_mixture(config, sources, split, task, symbols, scan)
    return load_lm_data(
        settings.data, split=split, task=task, tokens_per_sample=settings.tokens_per_sample,
        sample_break_mode=settings.sample_break_mode, seed=config.seed, mask_prob=settings.mask_prob,
        symbols=symbols, mask_special_tokens=settings.mask_special_tokens, scan=scan,
        document_mask=settings.document_mask,
    )


class MixtureData:
    """Samples of one split of several data directories with one vocabulary, mixed by weight
    (``--data 0.3:A 0.7:B``); build it with :func:`load_mixture`. ``index`` picks the source
    and sample of each mixture index (see :mod:`distlm.data.mixture`)."""

    def __init__(self, sources: Sequence[LMData], index: MixtureIndex) -> None:
        self.sources, self.index = list(sources), index
        first = self.sources[0]
        self.dictionary, self.tokenizer_dir = first.dictionary, first.tokenizer_dir
        self.task, self.tokens_per_sample, self.fixed_masks = first.task, first.tokens_per_sample, first.fixed_masks
        self.document_mask = first.document_mask

    def __len__(self) -> int:
        return len(self.index)

    def sample(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, targets)`` of one sample, as :meth:`LMData.sample`."""
        source, inner = self.index.locate(epoch, index)
        return self.sources[source].sample(epoch, inner)

    def document_ids(self, epoch: int, index: int) -> np.ndarray:
        """As :meth:`LMData.document_ids`, from the sample's source."""
        source, inner = self.index.locate(epoch, index)
        return self.sources[source].document_ids(epoch, inner)

    collate = LMData.collate  # it needs only ``sample``, ``document_ids`` and ``dictionary``

    def sizes_in_epoch(self, epoch: int) -> np.ndarray:
        """Input tokens of each mixture sample in ``epoch`` (``--max-tokens`` batches by them): an
        index is another sample of its source from epoch to epoch, so its length is too."""
        sources, inner = self.index.locate_all(epoch)
        sizes = np.empty(len(self), dtype=np.int64)
        for number, source in enumerate(self.sources):
            chosen = sources == number
            sizes[chosen] = source.sizes[inner[chosen]]
        return sizes

    @property
    def drawn_sizes(self) -> np.ndarray:
        """The lengths of every sample a training epoch can draw (of the sources with a share)."""
        return np.concatenate([source.sizes for source, count in zip(self.sources, self.index.counts) if count]
                              or [np.zeros(0, dtype=np.int64)])

    def check_symbols(self, symbols: Sequence[str]) -> None:
        """UsageError unless ``symbols`` (a checkpoint's) are the sources' vocabulary."""
        self.sources[0].check_symbols(symbols)

    def describe_sources(self) -> list[str]:
        """The start-up log's line for each source (its share and size)."""
        return self.index.describe_sources()

    def drawn(self, consumed: int, permutation: Callable[[int], np.ndarray]) -> dict[str, int]:
        """Training samples drawn from each source (by label) in the first ``consumed`` of the
        stream (``permutation``: the sampler's, see :meth:`MixtureIndex.drawn`)."""
        return dict(zip(self.index.labels(), self.index.drawn(consumed, permutation)))


def load_mixture(config: TrainConfig, sources: Sequence[tuple[float, str]], split: str, task: str,
                 symbols: Sequence[str] | None, scan: SharedScan | None = None) -> MixtureData:
    """Split ``split`` of each ``(weight, directory)`` source as the run's settings read it,
    refusing sources whose vocabularies differ. Every split but ``train`` mixes its sources
    by their sizes, each sample once, so that validation covers all of the held-out data."""
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
                     symbols=symbols, mask_special_tokens=settings.mask_special_tokens, scan=scan,
                     document_mask=settings.document_mask)
        for directory in directories
    ]
    training = split == "train"
    weights = [weight for weight, _ in sources] if training else [len(part) for part in parts]
    index = MixtureIndex([len(part) for part in parts], weights, directories, config.seed, shuffle=training)
    return MixtureData(parts, index)


def _vocabulary_file(directory: str, vocabulary: Vocabulary) -> str:
    name = "dict.txt" if isinstance(vocabulary, Dictionary) else "tokenizer.json"
    return f"{Path(directory) / name}: {len(vocabulary)} symbols"


def load_lm_data(
    path: str | os.PathLike | None,
    split: str,
    task: str,
    tokens_per_sample: int,
    sample_break_mode: str = "complete",
    seed: int = 1,
    mask_prob: float = 0.15,
    dictionary: Vocabulary | None = None,
    *,
    symbols: Sequence[str] | None = None,
    mask_special_tokens: bool = True,
    fixed_masks: bool | None = None,
    scan: SharedScan | None = None,
    document_mask: bool = False,
) -> LMData:
    """Open ``split`` of a data directory (``path=None``: the built-in corpus).

    The vocabulary is the directory's ``dict.txt`` (plus ``<mask>`` for masked_lm) or,
    without one, its Hugging Face tokenizer (see :func:`load_vocabulary`).

    ``dictionary`` (e.g. rebuilt from a checkpoint) must agree with the directory's
    vocabulary symbol for symbol, and then replaces a ``dict.txt`` one; ``symbols`` (the
    list a checkpoint stores) is only checked. A tokenizer's vocabulary is always the one
    read from its files, since a symbol list cannot say which ids are special.

    ``mask_special_tokens`` picks fairseq's masking rule (True) or never masking special
    tokens (see :class:`DynamicMasker`). ``fixed_masks`` makes the masks independent of
    the epoch; by default (None) every split but ``train`` has fixed masks. ``scan``: the
    ranks that share the check of the ids (a collective; see :class:`SharedScan`).
    ``document_mask`` (causal_lm): a document is one sequence of the files; a document's
    first token is no target and batches carry ``document_ids``.
    """
    if task not in TASKS:
        raise UsageError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if sample_break_mode not in SAMPLE_BREAK_MODES:
        raise UsageError(f"sample_break_mode {sample_break_mode!r} is not one of {', '.join(SAMPLE_BREAK_MODES)}")
    minimum = 2 if task == "masked_lm" else 1
    if tokens_per_sample < minimum:
        raise UsageError(f"tokens_per_sample {tokens_per_sample} must be at least {minimum} for {task}")
    check_shared_settings({"seed": seed})  # within --seed's bounds (distlm.config)

    directory = data_directory(path)
    data_vocabulary = load_vocabulary(directory, task)
    if not (directory / f"{split}.idx").is_file():
        raise UsageError(
            f"data path {directory} has no {split}.idx/.bin for split {split!r}; expected {_EXPECTED_LAYOUT}"
        )
    for given in (dictionary, symbols):
        if given is not None:
            _check_same_symbols(list(getattr(given, "symbols", given)), data_vocabulary, directory, task)
    if dictionary is not None and isinstance(data_vocabulary, Dictionary):
        data_vocabulary = dictionary

    tokens = MMapIndexedDataset(directory / split)
    data = LMData(
        tokens,
        data_vocabulary,
        task,
        tokens_per_sample,
        sample_break_mode,
        seed,
        mask_prob,
        mask_special_tokens=mask_special_tokens,
        fixed_masks=split != "train" if fixed_masks is None else fixed_masks,
        scan=scan,
        document_mask=document_mask,
    )
    if len(data) == 0:
        raise UsageError(f"split {split!r} of data path {directory} holds no {task} samples; it is empty")
    return data


def data_directory(path: str | os.PathLike | None) -> Path:
    """The data directory for ``path`` (``None``: the built-in corpus, built on first use)."""
    if path is None:
        return ensure_builtin_corpus()
    directory = Path(path)
    if not directory.is_dir():
        raise UsageError(f"data path {directory} is not a directory; expected {_EXPECTED_LAYOUT}")
    return directory


def load_vocabulary(path: str | os.PathLike | None, task: str) -> Vocabulary:
    """The vocabulary a model trains with on the data directory ``path`` for ``task``.

    ``dict.txt`` when the directory has one (with ``<mask>`` appended for masked_lm, as
    fairseq does), else its Hugging Face ``tokenizer.json`` as an :class:`HFVocabulary`
    (which checks that the tokenizer has the tokens ``task`` needs).
    """
    directory = data_directory(path)
    dict_path = directory / "dict.txt"
    if dict_path.is_file():
        vocabulary = Dictionary.load(dict_path)
        if task == "masked_lm":
            vocabulary.add_symbol(MASK_SYMBOL)
        return vocabulary
    if is_hf_tokenizer_dir(directory):
        return HFVocabulary.load(directory, task)
    raise UsageError(f"data path {directory} has neither dict.txt nor tokenizer.json; expected {_EXPECTED_LAYOUT}")


def _check_same_symbols(given: list[str], vocabulary: Vocabulary, directory: Path, task: str) -> None:
    """``given`` (a checkpoint's symbols) must be the data directory's ``vocabulary``, symbol for symbol."""
    source = directory / "dict.txt" if isinstance(vocabulary, Dictionary) else directory / "tokenizer.json"
    expected = vocabulary.symbols
    if len(given) != len(expected):
        raise UsageError(
            f"the given dictionary has {len(given)} symbols but {source} gives {len(expected)} "
            f"for {task}; resume with the data the checkpoint was trained on"
        )
    if given != expected:
        first = next(i for i, (a, b) in enumerate(zip(given, expected)) if a != b)
        raise UsageError(
            f"the given dictionary differs from {source} at index {first} "
            f"({given[first]!r} vs {expected[first]!r}); resume with the data the checkpoint was trained on"
        )
