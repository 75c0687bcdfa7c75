"""Training statistics: summed locally, reduced across ranks in one collective, with MFU.

``loss`` is reported in base 2 and ``ppl`` as 2**loss, as fairseq does, so numbers
compare directly with fairseq logs.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from distlm.backends.hardware import device_peak_flops, measure_cpu_matmul_flops
from distlm.errors import UsageError
from distlm.models.flops import attention_flops_per_pair, flops_per_token, model_flops_utilization
from distlm.models.registry import task_of
from distlm.observe.printer import significant

LN2 = math.log(2)
logger = logging.getLogger("distlm")
# Devices already reported as having no known peak (once per process, not per Trainer).
_REPORTED_WITHOUT_PEAK: set[str] = set()


class TrainStats:
    """Sums since the last log line; ``reduce`` adds them over the data-parallel group at once.

    The loss stays on the device until ``reduce``; the counts are host numbers known
    from the batches. So collecting statistics costs no host synchronisation per update,
    only one per log line.
    """

    FIELDS = ("loss_sum", "target_tokens", "input_tokens", "samples", "batch_tokens", "attention_pairs")

    def __init__(self, device: torch.device | str = "cpu", flops_per_token: float | None = None,
                 peak_flops_per_device: float | None = None, devices: int = 1,
                 attention_flops_per_pair: float | None = None) -> None:
        """``flops_per_token`` and ``peak_flops_per_device`` (None or 0: unknown) give the MFU
        of ``devices`` devices; the tokens are the global input tokens of the run.
        ``attention_flops_per_pair`` (packed documents with document masks): attention's FLOPs
        are counted from the (query, key) pairs the batches report, and ``flops_per_token``
        holds the rest."""
        self.device = torch.device(device)
        self.flops_per_token, self.peak_flops_per_device, self.devices = flops_per_token, peak_flops_per_device, devices
        self.attention_flops_per_pair = attention_flops_per_pair
        self.first: tuple[float, int, float, float] | None = None
        """Global input tokens, updates, seconds and attention pairs of the first logged
        interval of this process, whose updates compile and warm up."""
        self.steady = [0.0, 0, 0.0, 0.0]
        """The same summed over the logged intervals after the first."""
        self._start_interval()

    def _start_interval(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.counts = [0, 0, 0, 0, 0]
        self.updates = 0
        self.started = time.perf_counter()

    def add(self, loss_sum: torch.Tensor, target_tokens: int, input_tokens: int, samples: int,
            batch_tokens: int | None = None, attention_pairs: int | None = None) -> None:
        """``batch_tokens``: the batches' tokens, padding included (None: no padding);
        ``attention_pairs``: the (query, key) pairs their documents attend over (None: not counted)."""
        self.loss_sum += loss_sum.to(device=self.device, dtype=torch.float64)
        for i, count in enumerate((target_tokens, input_tokens, samples,
                                   input_tokens if batch_tokens is None else batch_tokens, attention_pairs or 0)):
            self.counts[i] += count
        self.updates += 1

    def reduce(self, group: dist.ProcessGroup | None) -> dict[str, float | None]:
        sums = torch.cat([self.loss_sum.reshape(1), torch.tensor(self.counts, dtype=torch.float64, device=self.device)])
        if group is not None:
            # One collective for every statistic (this is what fairseq's --fast-stat-sync asks for).
            dist.all_reduce(sums, group=group)
        elapsed = time.perf_counter() - self.started
        values = dict(zip(self.FIELDS, sums.tolist()))
        interval = (values["input_tokens"], self.updates, elapsed, values["attention_pairs"])
        if self.first is None:
            self.first = interval
        else:
            self.steady = [total + part for total, part in zip(self.steady, interval)]
        loss = values["loss_sum"] / max(values["target_tokens"], 1) / LN2
        rates = self._rates(*interval)
        return {
            "loss": significant(loss),
            "ppl": significant(perplexity(loss)),
            "wps": rates["wps"],
            "ups": rates["ups"],
            "bsz": values["samples"] / max(self.updates, 1),
            # The share of the batches' tokens that is padding (--max-tokens keeps it small).
            "padding": significant(1 - values["input_tokens"] / max(values["batch_tokens"], 1), 4),
            "tokens_per_sec_per_device": rates["tokens_per_sec_per_device"],
            "mfu": rates["mfu"],
        }

    def _rates(self, input_tokens: float, updates: int, seconds: float,
               attention_pairs: float = 0.0) -> dict[str, float | None]:
        tokens_per_s = input_tokens / seconds
        return {"wps": significant(tokens_per_s, 5), "ups": significant(updates / seconds, 4),
                "tokens_per_sec_per_device": significant(tokens_per_s / self.devices, 5),
                "mfu": significant(self.mfu(tokens_per_s, attention_pairs / seconds), 5)}

    def mfu(self, tokens_per_s: float, attention_pairs_per_s: float = 0.0) -> float | None:
        """Model FLOP/s over the peak of every device; None when the model's FLOPs or the
        device's peak are unknown (the log prints null, never a made-up 0)."""
        if not self.peak_flops_per_device or not self.flops_per_token:
            return None
        per_token = self.flops_per_token
        if self.attention_flops_per_pair and tokens_per_s:
            per_token += self.attention_flops_per_pair * attention_pairs_per_s / tokens_per_s
        return model_flops_utilization(tokens_per_s, per_token, self.peak_flops_per_device, self.devices)

    def summary_rates(self) -> dict[str, Any]:
        """The summary line's wps, ups, tokens per second per device and MFU, all over the
        window ``rates_over`` names: ``after_first_interval`` (steady state: the first logged
        interval compiles and warms up), or ``whole_run`` where only one interval was logged;
        {} before any."""
        if self.steady[1]:
            return {**self._rates(*self.steady), "rates_over": "after_first_interval"}
        if self.first is not None:
            return {**self._rates(*self.first), "rates_over": "whole_run"}
        return {}

    def reset(self) -> None:
        self._start_interval()


def run_stats(model: torch.nn.Module, data: Any, task: str, device: torch.device, dtype: torch.dtype,
              world_size: int) -> TrainStats:
    """The statistics of a run of ``model`` (unwrapped) on ``data`` (the config's ``DataConfig``)
    over ``world_size`` devices. A pipeline stage keeps the whole model's config, so its FLOPs
    per token are the model's: global tokens times those, over every device's peak, as without
    stages."""
    return TrainStats(device, *mfu_inputs(model, data.tokens_per_sample, device.type, dtype,
                                          task_of(task).output_fraction(data.mask_prob), data.document_mask),
                      world_size, document_attention_flops(model, data.document_mask))


def mfu_inputs(
    model: torch.nn.Module, seq_len: int, device_type: str, dtype: torch.dtype, output_fraction: float = 1.0,
    document_mask: bool = False,
) -> tuple[float | None, float | None]:
    """(FLOPs per token, peak FLOP/s per device) for MFU; None where the model's shape or
    the device's peak is unknown (a user's model, a device without a table entry). A
    device without a peak is reported once, with how to give one. ``output_fraction``:
    the share of positions the model computes its output at (a masked LM's mask rate).
    ``document_mask``: the FLOPs per token leave attention out, which the batches' documents
    count (``document_attention_flops``)."""
    try:
        per_token = flops_per_token(model, seq_len, output_fraction)
        if document_mask:
            per_token -= attention_flops_per_pair(model) * seq_len
    except (TypeError, UsageError):
        per_token = None
    try:
        peak = measure_cpu_matmul_flops(dtype) if device_type == "cpu" else device_peak_flops(device_type, dtype)
    except UsageError as exc:
        peak = None
        if device_type not in _REPORTED_WITHOUT_PEAK and (not dist.is_initialized() or dist.get_rank() == 0):
            _REPORTED_WITHOUT_PEAK.add(device_type)
            logger.warning("mfu is null in the log: %s", exc)
    return per_token, peak


def document_attention_flops(model: torch.nn.Module, document_mask: bool) -> float | None:
    """With document masks, the training FLOPs of one (query, key) pair (None without them, or
    for a model of unknown shape: MFU is then null, see ``mfu_inputs``)."""
    if not document_mask:
        return None
    try:
        return attention_flops_per_pair(model)
    except (TypeError, UsageError):
        return None


def perplexity(loss_bits: float) -> float:
    """2**loss, inf once it exceeds what a float holds (never OverflowError), nan for nan."""
    try:
        return 2.0**loss_bits
    except OverflowError:
        return math.inf
