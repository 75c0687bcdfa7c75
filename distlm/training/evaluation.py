"""Validation: the loss over whole validation splits, the best value, and early stopping.

Every data-parallel rank evaluates its share of each split (``--valid-subset``) with
dropout off and no gradients; the summed loss and the target-token count are added
across ranks before dividing, so the result is the loss over the whole split, exactly
what one process computes, not an average of per-rank averages. Masked-LM masks of a
validation split are fixed, so two runs, and two epochs of one run, compare.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from distlm.checkpoint import TrainProgress
from distlm.config import TrainConfig, valid_subsets
from distlm.data import GlobalBatchSampler, MixtureData, SharedScan, load_split
from distlm.data.batches import padded_to, to_device, with_host_facts
from distlm.data.masking import IGNORE_INDEX
from distlm.data.sampler import token_budget_batches
from distlm.errors import UsageError
from distlm.observe.printer import significant
from distlm.runtime.context import DistContext
from distlm.training.stats import LN2, perplexity

logger = logging.getLogger("distlm")


@dataclass
class ValidationResult:
    subset: str
    loss: float
    """Cross-entropy in base 2 over every target token of the subset."""
    target_tokens: int

    @property
    def ppl(self) -> float:
        return perplexity(self.loss)


def load_validation_subsets(config: TrainConfig, task: str, symbols: list[str] | None,
                            scan: SharedScan | None = None, data_given: bool = False,
                            is_main: bool = False) -> dict[str, Any]:
    """Each split of ``--valid-subset`` (none with ``--disable-validation``), with fixed masks;
    ``scan``: the ranks that share the check of their ids (a collective). None either when
    the Trainer was handed its training data (``data_given``): the valid split of --data
    belongs to --data, not to that data; rank 0 (``is_main``) says so."""
    settings = config.data
    if settings.disable_validation:
        return {}
    if data_given:
        if is_main:
            logger.info("validation: off, as train_data was given (the valid split of --data belongs to --data)")
        return {}
    return {name: load_split(config, name, task, symbols, scan) for name in valid_subsets(settings)}


class Validator:
    """Runs validation when it is due and keeps the best value and the patience count.

    ``subsets`` maps a split name to its data (``load_validation_subsets``); empty: no
    validation. The callables are the trainer's own: the loss, tensor parallel's loss
    context, the plain value of a (DTensor) loss, and forward's mixed precision.
    ``positions``: batches carry their targets' flat positions (a masked LM selects its
    rows by them).
    """

    def __init__(self, config: TrainConfig, ctx: DistContext, subsets: dict[str, Any],
                 compute_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor], loss_context: Callable,
                 local_loss: Callable[[torch.Tensor], torch.Tensor], autocast: Callable, pad_to: int | None = None,
                 positions: bool = True, training: tuple[Any, GlobalBatchSampler] | None = None):
        self.config, self.ctx, self.subsets, self.pad_to, self.positions = config, ctx, subsets, pad_to, positions
        self.training = training
        """The training data and its sampler: a mixture's per-source lines say how many training
        samples each source has given so far."""
        self.compute_loss, self.loss_context, self.local_loss, self.autocast = (
            compute_loss, loss_context, local_loss, autocast)
        self.enabled = bool(subsets)
        self.sum_dtype = torch.float32 if ctx.backend.static_shapes else torch.float64
        """Of the loss sums on the device (see ``_subset``)."""
        self._validated_at: int | None = None
        self.batch_size = config.data.batch_size_valid or config.data.batch_size
        self.max_tokens = config.data.max_tokens_valid or config.data.max_tokens
        """--max-tokens-valid (default --max-tokens): batches by a token budget; None: of --batch-size-valid samples."""
        self.metric = config.checkpoint.best_checkpoint_metric
        self.maximize = config.checkpoint.maximize_best_checkpoint_metric
        self._token_batches: dict[str, list[list[np.ndarray]]] = {}
        if self.max_tokens is not None:  # refused now, not at the first validation
            for name, data in subsets.items():
                parts = zip(data.index.labels(), data.sources) if isinstance(data, MixtureData) else [(None, data)]
                for label, part in parts:
                    self._token_batches[name if label is None else f"{name}/{label}"] = self._cut(name, part)
        if self.enabled and ctx.is_main:
            logger.info("validation: %s", ", ".join(f"{name} ({len(data)} samples)" for name, data in subsets.items()))

    def _cut(self, name: str, data: Any) -> list[list[np.ndarray]]:
        """Each data-parallel rank's batches of ``data`` within --max-tokens-valid (rank r takes
        every dp-th sample, as with --batch-size-valid), validation samples longer than the
        budget refused in one line or, with --skip-invalid-size-inputs-valid-test, left out."""
        settings, dp = self.config.data, self.ctx.dims.dp
        if not hasattr(data, "sizes"):
            raise UsageError(f"--max-tokens-valid needs the sample lengths of validation split {name}, which its "
                             "data does not give: batch it with --batch-size-valid")
        sizes = np.asarray(data.sizes, dtype=np.int64)
        too_long = sizes > self.max_tokens
        if too_long.any() and not settings.skip_invalid_size_inputs_valid_test:
            raise UsageError(
                f"{int(too_long.sum())} of the {len(sizes)} samples of validation split {name} are longer than "
                f"--max-tokens-valid {self.max_tokens} (the longest has {int(sizes.max())} tokens): raise "
                f"--max-tokens-valid to at least {int(sizes.max())}, or skip them with "
                "--skip-invalid-size-inputs-valid-test")
        if too_long.any() and self.ctx.is_main:
            logger.warning("--skip-invalid-size-inputs-valid-test: %d samples of validation split %s longer than "
                           "--max-tokens-valid %d are left out", int(too_long.sum()), name, self.max_tokens)
        kept = np.flatnonzero(~too_long)
        return [token_budget_batches(sizes, kept[rank::dp], self.max_tokens, self.batch_size,
                                     settings.required_batch_size_multiple) for rank in range(dp)]

    def due(self, num_updates: int, end_of_epoch: int | None, done: bool) -> bool:
        """fairseq's rule: at the end of every --validate-interval epochs, every
        --validate-interval-updates updates, and when training stops."""
        if not self.enabled or num_updates == self._validated_at:
            return False  # an epoch that ended on a skipped update was validated at this update already
        settings = self.config.data
        every_updates = settings.validate_interval_updates
        return (
            done
            or (end_of_epoch is not None and end_of_epoch % settings.validate_interval == 0)
            or (every_updates > 0 and num_updates % every_updates == 0)
        )

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, max_batches: int | None = None) -> list[ValidationResult]:
        """The loss over each subset (collective over every rank), then over each source of a
        mixture's subsets; ``max_batches`` (and --max-valid-steps) cuts each source short."""
        was_training = model.training
        model.eval()
        try:
            results, per_source = [], []
            for name, data in self.subsets.items():
                if not isinstance(data, MixtureData):
                    results.append(self._subset(name, data, model, max_batches))
                    continue
                # A mixture's split holds each sample of its sources' splits once: each source
                # is validated on its own (SPLIT/SOURCE, after every split's own line), and the
                # loss over the whole split is their loss sums over their target tokens.
                parts = [self._subset(f"{name}/{label}", source, model, max_batches)
                         for label, source in zip(data.index.labels(), data.sources)]
                per_source += parts
                tokens = sum(part.target_tokens for part in parts)
                results.append(ValidationResult(
                    name, sum(part.loss * part.target_tokens for part in parts) / max(tokens, 1), tokens))
            return results + per_source
        finally:
            model.train(was_training)

    def _subset(self, name: str, data: Any, model: torch.nn.Module, max_batches: int | None) -> ValidationResult:
        dims = self.ctx.dims
        # Rank r of the data-parallel group takes every dp-th sample; every rank runs the
        # same number of batches (sharded forward passes are collectives), the ranks that
        # run out evaluate a batch whose targets are all ignored.
        mine = np.arange(self.ctx.dp_rank, len(data), dims.dp)
        batches = math.ceil(len(data) / (dims.dp * self.batch_size))
        by_tokens = self._token_batches.get(name)
        if by_tokens is not None:  # --max-tokens-valid: as many batches as the rank with the most
            batches = max(len(cut) for cut in by_tokens)
        for limit in (self.config.data.max_valid_steps, max_batches):
            if limit:
                batches = min(batches, limit)
        # A traced device (XLA: static_shapes) compiles what runs between two step markers
        # as one graph: marking a step after every batch keeps one graph per batch shape
        # however long the split is. It sums in float32, which NeuronCores compute natively
        # (float64 they do not); the host takes the sums on in float64.
        traced = self.ctx.backend.static_shapes
        sums = torch.zeros(2, dtype=self.sum_dtype, device=self.ctx.device)
        for step in range(batches):
            if by_tokens is None:
                indices = mine[step * self.batch_size:(step + 1) * self.batch_size]
            else:
                own = by_tokens[self.ctx.dp_rank]
                indices = own[step] if step < len(own) else mine[:0]
            batch = dict(data.collate([(0, int(i)) for i in (indices if len(indices) else [0])]))
            if not len(indices):
                batch["targets"] = torch.full_like(batch["targets"], IGNORE_INDEX)
                batch.pop("ntokens", None)  # counted from the (ignored) targets instead: none
            pad = data.dictionary.pad()
            # Under compile or XLA every batch has one shape: the last, short batches too.
            rows = self.batch_size if self.pad_to is not None else None
            batch = to_device(with_host_facts(padded_to(batch, self.pad_to, pad, rows), pad, self.positions),
                              self.ctx.device)
            with self.loss_context(), self.autocast():
                loss = self.compute_loss(batch)
            sums[0] += self.local_loss(loss.detach()).to(sums.dtype)
            sums[1] += batch["target_count"]
            if traced:
                self.ctx.backend.mark_step()
        if self.ctx.dp_group is not None:
            dist.all_reduce(sums, group=self.ctx.dp_group)
        loss_sum, tokens = sums.tolist()
        return ValidationResult(name, loss_sum / max(tokens, 1) / LN2, int(tokens))

    def value(self, result: ValidationResult) -> float:
        return result.ppl if self.metric == "ppl" else result.loss

    def is_better(self, value: float, best: float | None) -> bool:
        if not math.isfinite(value):
            return False
        return best is None or (value > best if self.maximize else value < best)

    def record(self, results: list[ValidationResult], progress: TrainProgress) -> bool:
        """Update the best value and the patience count from the first subset; True if it improved."""
        self._validated_at = progress.num_updates
        value = self.value(results[0])
        improved = self.is_better(value, progress.best)
        if improved:
            progress.best = value
            progress.validations_without_improvement = 0
        else:
            progress.validations_without_improvement += 1
        return improved

    def out_of_patience(self, progress: TrainProgress) -> bool:
        """True (and rank 0 says so) after --patience validations without improvement."""
        patience = self.config.checkpoint.patience
        stop = patience > 0 and progress.validations_without_improvement >= patience
        if stop and self.ctx.is_main:
            logger.info("early stop: validation %s has not improved for the last %d validations (--patience)",
                        self.metric, patience)
        return stop

    def log_records(self, results: list[ValidationResult], progress: TrainProgress) -> list[dict[str, Any]]:
        records = [
            {"subset": r.subset, "update": progress.num_updates, "loss": significant(r.loss), "ppl": significant(r.ppl),
             f"best_{self.metric}": significant(progress.best)}
            for r in results
        ]
        data, sampler = self.training or (None, None)
        if isinstance(data, MixtureData):
            drawn = data.drawn(progress.consumed_samples, sampler.permutation)
            for record in records:
                label = record["subset"].partition("/")[2]
                if label in drawn:
                    record["train_samples"] = drawn[label]
        return records
