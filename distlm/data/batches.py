"""Each update's micro-batches for this rank, prepared on the host (optionally by worker processes)."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterator

import torch

from distlm.data.masking import IGNORE_INDEX
from distlm.data.sampler import GlobalBatchSampler, TokenBudgetSampler
from distlm.errors import UsageError
from distlm.runtime.signals import ignore_stop_signals

logger = logging.getLogger("distlm")
Sampler = GlobalBatchSampler | TokenBudgetSampler


class UpdateBatches(torch.utils.data.Dataset):
    """Item k: the micro-batches of the k-th update from ``start`` consumed samples on,
    with their token counts as host numbers, read here before any device sees them."""

    def __init__(self, data: Any, sampler: Sampler, start: int, pad: int, pad_to: int | None = None,
                 positions: bool = True):
        self.data, self.sampler, self.start, self.pad, self.pad_to = data, sampler, start, pad, pad_to
        self.positions = positions

    def __getitem__(self, k: int) -> list[dict[str, Any]]:
        return [with_host_facts(padded_to(self.data.collate(pairs), self.pad_to, self.pad), self.pad, self.positions)
                for pairs in self.sampler.update_micro_batches(self.start, k)]


def padded_to(batch: dict[str, Any], length: int | None, pad: int, rows: int | None = None) -> dict[str, Any]:
    """``batch`` right-padded to ``length`` tokens (None: as collated, the longest sample),
    and with padding rows up to ``rows`` samples (None: as many as collated).

    Compiled graphs and XLA's traced ones are specialised to their shapes: batches of one
    fixed shape run one graph instead of one per shape. Padding carries no target.
    """
    height, width = batch["input_ids"].shape
    extra_columns = max(0, (length or width) - width)
    extra_rows = max(0, (rows or height) - height)
    if not extra_columns and not extra_rows:
        return batch
    pad_shape = (0, extra_columns, 0, extra_rows)
    padded = {**batch,
              "input_ids": torch.nn.functional.pad(batch["input_ids"], pad_shape, value=pad),
              "targets": torch.nn.functional.pad(batch["targets"], pad_shape, value=IGNORE_INDEX)}
    if "document_ids" in batch:
        # Padding is a document of its own (-1), as collate makes it, so no token sees it.
        padded["document_ids"] = torch.nn.functional.pad(batch["document_ids"], pad_shape, value=-1)
    return padded


def with_host_facts(batch: dict[str, Any], pad: int, positions: bool = True) -> dict[str, Any]:
    """``batch`` plus what the host knows about it before any device sees it: token counts,
    whether it holds padding, and (``positions``: for a model that selects its masked rows
    by them) the flat positions of its targets. Read here, they cost the device no
    synchronisation later."""
    batch = dict(batch)
    targets = batch["targets"]
    batch["target_count"] = int(batch["ntokens"]) if "ntokens" in batch else int((targets != IGNORE_INDEX).sum())
    batch["input_count"] = int((batch["input_ids"] != pad).sum())
    batch["has_padding"] = batch["input_count"] < batch["input_ids"].numel()
    if positions:
        batch["masked_positions"] = torch.nonzero(targets.flatten() != IGNORE_INDEX).squeeze(1)
    if "document_ids" in batch:
        batch["attention_pairs"] = attention_pairs(batch["document_ids"])
    return batch


def attention_pairs(document_ids: torch.Tensor) -> int:
    """The (query, key) pairs that attention within documents computes over a batch's rows,
    counted as MFU counts a sequence's (its length squared): the sum of the documents'
    squared lengths, padding (id -1) left out."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    segment = starts.flatten().cumsum(0)
    lengths = torch.bincount(segment[document_ids.flatten() != -1])
    return int(lengths.square().sum())


def update_batches(data: Any, sampler: Sampler, start: int, pad: int, num_workers: int,
                   pad_to: int | None = None, positions: bool = True) -> Iterator[list[dict[str, Any]]]:
    """The micro-batches of every coming update, by ``num_workers`` processes (0: this one)."""
    dataset = UpdateBatches(data, sampler, start, pad, pad_to, positions)
    if num_workers == 0:
        return map(dataset.__getitem__, itertools.count())
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=itertools.count(), num_workers=num_workers,
                                         worker_init_fn=ignore_stop_signals)
    return iter(loader)


def training_sampler(config: Any, data: Any, dp_rank: int, dp_size: int, fixed_length: int | None,
                     is_main: bool) -> Sampler:
    """The sampler of the training data: --batch-size samples per micro-batch, or with
    --max-tokens batches within a token budget (``fixed_length``: the length every batch is
    padded to for compiled, traced or pipelined graphs, which --max-tokens cannot give)."""
    settings = config.data
    if settings.max_tokens is None:
        sampler = GlobalBatchSampler(num_samples=len(data), micro_batch_size=settings.batch_size,
                                     update_freq=settings.update_freq, dp_rank=dp_rank, dp_size=dp_size,
                                     seed=config.seed)
        check_global_batch(sampler, len(data), settings.batch_size, settings.update_freq)
        return sampler
    if fixed_length is not None:
        raise UsageError("--max-tokens makes batches of varying shapes, which --compile, pipeline parallelism and "
                         "static-shape devices cannot take: use --batch-size there")
    budget = (settings.max_tokens, settings.batch_size, settings.required_batch_size_multiple, settings.update_freq,
              dp_rank, dp_size, config.seed, settings.skip_invalid_size_inputs_valid_test)
    if hasattr(data, "sizes_in_epoch"):  # a mixture: each epoch draws other samples of its sources
        sampler = TokenBudgetSampler(data.drawn_sizes, *budget, epoch_sizes=data.sizes_in_epoch,
                                     num_samples=len(data))
    elif hasattr(data, "sizes"):
        sampler = TokenBudgetSampler(data.sizes, *budget)
    else:
        raise UsageError("--max-tokens needs the training data's sample lengths, which data handed to the Trainer "
                         "without a `sizes` array does not give: batch with --batch-size")
    if is_main:
        if sampler.skipped:
            logger.warning("--skip-invalid-size-inputs-valid-test: %d training samples longer than --max-tokens %d "
                           "are left out", sampler.skipped, settings.max_tokens)
        logger.info("--max-tokens %d: %d batches of %d samples %s, %d per update", settings.max_tokens,
                    sampler.num_batches, sampler.num_samples,
                    "per epoch" if sampler.epoch_sizes is None else "in the first epoch (each epoch its own)",
                    sampler.batches_per_update)
    return sampler


def check_global_batch(sampler: GlobalBatchSampler, num_samples: int, batch_size: int, update_freq: int) -> None:
    if sampler.global_batch_size > num_samples:
        raise UsageError(
            f"the global batch (--batch-size {batch_size} x --update-freq {update_freq} "
            f"x {sampler.dp_size} replicas = {sampler.global_batch_size}) exceeds the {num_samples} "
            "training samples; lower --batch-size or --update-freq, or use fewer ranks"
        )


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on ``device`` (asynchronous copies), its host facts as they are."""
    return {key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for key, value in batch.items() if key != "ntokens"}
