"""Trainer: the loop (step, log, save) over a model parallelised from outside.

One update is: ``--update-freq`` micro-batches, gradients synchronised on the last
only; the summed loss divided once by the global number of target tokens; unscale,
clip, finite check, step, learning rate. The data position is one global count of
consumed samples, so the next batch is known exactly after a resume. An update costs
one host synchronisation: the finite check of the gradient norm.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from distlm.builder import build_model_for_run, resolve_model_spec
from distlm.checkpoint import TOKENIZER_DIR, Checkpointer, TrainProgress
from distlm.config import TrainConfig
from distlm.data import GlobalBatchSampler, load_lm_data
from distlm.distributed import DistContext, init_distributed
from distlm.errors import UsageError
from distlm.loss import summed_cross_entropy
from distlm.memory import memory_report
from distlm.metrics import Printer, TrainStats
from distlm.data.hf_tokenizer import save_tokenizer
from distlm.optim import AdamWSettings, LRSchedule
from distlm.parallel.api import ParallelOptions, parallelize
from distlm.parallel.names import tied_aliases, unwrap
from distlm.parallel.replicas import first_replica_drift
from distlm.precision import Precision

logger = logging.getLogger("distlm")


class Trainer:
    """``Trainer(config).fit()`` trains and returns the final metrics.

    ``model`` may be the user's own single-device module meeting the model contract
    (distlm/models/contract.py); ``train_data`` any object with ``__len__`` and
    ``collate(pairs) -> {"input_ids", "targets", "ntokens"}`` where ``pairs`` are
    ``(epoch, index)`` and targets are -100 where there is nothing to predict.
    By default both come from ``--arch`` and ``--data``. ``dist`` reuses a context
    from ``distlm.distributed.init_distributed``.
    """

    def __init__(self, config: TrainConfig, model: torch.nn.Module | None = None, train_data: Any = None,
                 dist: DistContext | None = None):
        self.config = config
        self.ctx = dist if dist is not None else init_distributed(config, model)
        self.spec = resolve_model_spec(config.model) if model is None else None
        self.task = config.data.task or (model.task if model is not None else self.spec.task)
        self.arch = self.spec.name if model is None else type(model).__name__
        self.checkpointer = Checkpointer(config.checkpoint, self.ctx, self.arch, self.task)
        self.checkpointer.prepare()
        resume = self.checkpointer.find_resume()
        self.data = train_data if train_data is not None else self._load_data(resume.dictionary if resume else None)
        self.precision = Precision.from_config(config.precision_mode, config.precision)
        dictionary = getattr(self.data, "dictionary", None)
        build = build_model_for_run(
            self.spec, len(dictionary) if dictionary is not None else 0, dictionary.pad() if dictionary is not None else 1,
            self.ctx.dims, self.ctx.device, self.precision.param_dtype, config.seed, model,
            load_hf_weights=resume is None or resume.weights_only,
        )
        self.uses_masked_tokens = build.uses_masked_tokens and self.task == "masked_lm"
        self.model, self.handle = parallelize(build.model, self.ctx.dims, self.ctx.device, self._parallel_options(),
                                              build.whole_model, build.fill_shards)
        if resume is None:
            logger.info("starting from %s", f"the weights in --init-from-hf {self.spec.hf_dir}"
                        if self.spec is not None and self.spec.hf_dir is not None else f"seed {config.seed}")
        self.optimizer = self.handle.build_optimizer(AdamWSettings.from_config(config.optim), self.precision.param_dtype)
        self.sampler = GlobalBatchSampler(
            num_samples=len(self.data), micro_batch_size=config.data.batch_size, update_freq=config.data.update_freq,
            dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dims.dp, seed=config.seed,
        )
        if self.sampler.global_batch_size > len(self.data):
            raise UsageError(
                f"the global batch (--batch-size {config.data.batch_size} x --update-freq {config.data.update_freq} "
                f"x {self.ctx.dims.dp} replicas = {self.sampler.global_batch_size}) exceeds the {len(self.data)} "
                "training samples; lower --batch-size or --update-freq, or use fewer ranks"
            )
        epoch_updates = math.ceil(config.optim.max_epoch * len(self.data) / self.sampler.global_batch_size)
        self.schedule = LRSchedule(config.optim, updates_in_run=epoch_updates)
        self.progress = TrainProgress()
        self.last_memory: dict[str, int] = {}
        self.resumed_at: int | None = None
        """The update this run resumed at; None for a fresh start."""
        if resume is not None:
            self.progress = self.checkpointer.load(resume, self.model, self.optimizer, self.precision.scaler, config.seed)
            self.resumed_at = self.progress.num_updates
        else:
            # Dropout differs per data-parallel replica, yet reproducibly; the tensor-parallel
            # ranks of one replica must draw the same masks in their replicated regions.
            torch.manual_seed(config.seed * 1000 + self.ctx.dp_rank)

    def _load_data(self, symbols: list[str] | None):
        cfg = self.config.data
        return load_lm_data(
            cfg.data, split="train", task=self.task, tokens_per_sample=cfg.tokens_per_sample,
            sample_break_mode=cfg.sample_break_mode, seed=self.config.seed, mask_prob=cfg.mask_prob,
            symbols=symbols, mask_special_tokens=cfg.mask_special_tokens,
        )

    def _parallel_options(self) -> ParallelOptions:
        cfg = self.config.distributed
        return ParallelOptions(
            precision=self.config.precision_mode, sequence_parallel=cfg.sequence_parallel,
            activation_checkpointing=cfg.activation_checkpointing, bucket_cap_mb=cfg.bucket_cap_mb,
            comm_hook=cfg.comm_hook, comm_transport=cfg.comm_transport, double_buffering=cfg.double_buffering,
            ranks_per_node=cfg.ranks_per_node, cpu_offload=cfg.cpu_offload,
            node_of_rank=self.ctx.node_of_rank() if cfg.comm_hook.startswith("hierarchical") else None,
        )

    # ----------------------------------------------------------------------- loop

    def update_batches(self) -> Iterator[list[dict[str, Any]]]:
        """This rank's micro-batches for each coming update, prepared by --num-workers processes."""
        dataset = _UpdateBatches(self.data, self.sampler, self.progress.consumed_samples, self._pad)
        if self.config.data.num_workers == 0:
            return map(dataset.__getitem__, itertools.count())
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, sampler=itertools.count(), num_workers=self.config.data.num_workers
        )
        return iter(loader)

    def fit(self) -> dict[str, Any]:
        cfg = self.config
        printer = Printer(cfg.logging.log_format, cfg.optim.max_update or None, self.ctx.is_main)
        stats = TrainStats(self.ctx.device)
        summary: dict[str, Any] = {}
        batches = self.update_batches()
        try:
            while not self._done():
                started = time.perf_counter()
                epoch_before = self.sampler.epoch_of(self.progress.consumed_samples)
                with self.ctx.naming_failed_collectives(self.progress.num_updates + 1):
                    record = self.train_step(next(batches))
                self.progress.train_wall += time.perf_counter() - started
                applied = record.pop("applied")
                stats.add(record.pop("loss_sum"), record.pop("target_tokens"), record.pop("input_tokens"),
                          record.pop("samples"))
                printer.progress()
                if self.progress.num_updates % cfg.logging.log_interval == 0 or self._done():
                    summary = {"update": self.progress.num_updates, **stats.reduce(self.ctx.dp_group), **record,
                               "gnorm": round(record["gnorm"], 3), "train_wall": round(self.progress.train_wall, 2)}
                    printer.log(summary)
                    stats.reset()
                epoch_after = self.sampler.epoch_of(self.progress.consumed_samples)
                ended = epoch_before + 1 if epoch_after > epoch_before else None
                if applied and not self._done():
                    self.save_checkpoint(self.checkpointer.due(self.progress.num_updates, ended, done=False))
        finally:
            printer.close()
        self.save_checkpoint()
        self.checkpointer.wait()
        final = {**summary, "update": self.progress.num_updates, "consumed_samples": self.progress.consumed_samples,
                 "train_wall": round(self.progress.train_wall, 2),
                 "memory_bytes_per_rank": self.ctx.all_gather_object(self.last_memory)}
        printer.log(final, kind="summary")
        self.ctx.close()
        return final

    def save_checkpoint(self, names: list[str] | None = None) -> None:
        """Save now (collective); by default ``checkpoint_last``, as at the end of a run."""
        names = self.checkpointer.due(self.progress.num_updates, None, done=True) if names is None else names
        if not names:
            return
        # In-flight gradients are not saved: a resumed run refills the pipeline with one
        # update that applies nothing, as the first update of any run does.
        self.handle.wait_pending()
        self.checkpointer.save(names, self.progress, self.model, self.optimizer, self.precision.scaler,
                               self._describe(), self._write_tokenizer)

    def _describe(self) -> dict[str, Any]:
        """What distlm.json records beyond the training state: enough to export the model."""
        dictionary = getattr(self.data, "dictionary", None)
        model_config = getattr(unwrap(self.model), "config", None)
        return {
            "config": self.config.to_dict(),
            "dictionary": list(dictionary.symbols) if dictionary is not None else None,
            "tied_weights": tied_aliases(self.model),
            "family": self.spec.family if self.spec is not None else None,
            "model_config": dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else None,
            "special_tokens": dataclasses.asdict(self.spec.hf_tokens) if self.spec and self.spec.hf_tokens else None,
        }

    def _write_tokenizer(self, directory: Path) -> None:
        """The tokenizer the data was made with, as Hugging Face files, into a checkpoint (rank 0)."""
        dictionary = getattr(self.data, "dictionary", None)
        if dictionary is None:
            return
        try:
            save_tokenizer(dictionary, directory / TOKENIZER_DIR, self.task)
        except UsageError as err:
            logger.info("checkpoint without tokenizer files: %s", err)

    def _done(self) -> bool:
        cfg = self.config.optim
        if cfg.max_update and self.progress.num_updates >= cfg.max_update:
            return True
        return bool(cfg.max_epoch) and self.progress.consumed_samples >= cfg.max_epoch * len(self.data)

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """One update over this rank's ``--update-freq`` micro-batches."""
        device = self.ctx.device
        local_targets = sum(b["target_count"] for b in micro_batches)
        tensors = [{k: b[k].to(device, non_blocking=True) for k in ("input_ids", "targets")} for b in micro_batches]
        global_targets = torch.tensor([local_targets], dtype=torch.float64, device=device)
        if self.ctx.dp_group is not None:
            dist.all_reduce(global_targets, group=self.ctx.dp_group)
        loss_scale = self.precision.loss_scale
        # DDP averages gradients over replicas; multiplying by their number makes the
        # result the gradient of (summed loss / global target tokens): normalised once.
        # A device tensor, so nothing waits for the count to reach the host.
        factor = (self.ctx.dims.dp * loss_scale / global_targets.clamp(min=1)).float()
        gradient_loss_scale = self.handle.gradient_loss_scale(loss_scale)

        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        autocast = not self.handle.mixed_precision_by_strategy
        for i, batch in enumerate(tensors):
            with self.handle.gradient_sync(enabled=i == len(tensors) - 1), self.handle.loss_context():
                with self.precision.autocast(self.ctx.backend.autocast_device_type, enabled=autocast):
                    loss = self.compute_loss(batch)
                (loss * factor).backward()
            loss_sum += self.handle.local_loss(loss.detach()).double()

        update = self.progress.num_updates + 1
        lr = self.schedule.apply(self.optimizer, update - self.progress.lr_schedule_start)
        gnorm = self._unscale_and_clip(gradient_loss_scale)
        finite = math.isfinite(float(gnorm))  # the update's one host synchronisation
        applied = finite and self.handle.gradients_ready
        if not finite:
            logger.info("update %d: gradient overflow at loss scale %g, update skipped", update, loss_scale)
        elif not applied:
            logger.info("double buffering: the first update's gradients are still in flight; it applies no update")
        else:
            with self.handle.mixed_placements():
                self.ctx.backend.optimizer_step(self.optimizer)
            self.progress.num_updates = update
        if self.precision.scaler is not None:
            self.precision.scaler.update(not finite)
        self.progress.consumed_samples += self.sampler.global_batch_size  # before _done(), which --max-epoch reads
        if self._done() or self.progress.num_updates % self.config.logging.log_interval == 0:
            # Measured while gradients still exist: zero_grad below frees them.
            self.last_memory = memory_report(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.ctx.backend.mark_step()
        if self.config.distributed.check_replicas:
            self.check_replicas()
        record = {
            "loss_sum": loss_sum, "target_tokens": local_targets,
            "input_tokens": sum(b["input_count"] for b in micro_batches),
            "samples": sum(len(b["input_ids"]) for b in micro_batches),
            "lr": float(f"{lr:.6g}"), "gnorm": float(gnorm), "applied": applied,
        }
        if self.precision.scaler is not None:
            record["loss_scale"] = self.precision.loss_scale
        return record

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed cross-entropy over the batch's targets (divided by the global count in train_step)."""
        return summed_cross_entropy(self.model, batch, self.uses_masked_tokens)

    @property
    def num_updates(self) -> int:
        """Updates applied so far (skipped ones do not count)."""
        return self.progress.num_updates

    @property
    def consumed_samples(self) -> int:
        """Global position in the training data: samples of every rank consumed so far."""
        return self.progress.consumed_samples

    @property
    def _pad(self) -> int:
        dictionary = getattr(self.data, "dictionary", None)
        return dictionary.pad() if dictionary is not None else -1

    def _unscale_and_clip(self, loss_scale: float) -> torch.Tensor:
        if loss_scale != 1.0:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            with self.handle.mixed_placements():
                torch._foreach_mul_(grads, 1.0 / loss_scale)
        return self.handle.clip_grad_norm_(self.config.optim.clip_norm or math.inf)

    def check_replicas(self) -> None:
        """``--check-replicas``: every copy of a parameter is bit-identical after every update."""
        drift = first_replica_drift(self.model, self.ctx.dims, self.ctx.device.type)
        # A drift is seen only inside the group holding it; every rank must stop together,
        # or the others wait for it in the next collective until the timeout.
        if self.ctx.all_ranks_agree(drift is not None) and drift is None:
            drift = "parameters differ between replicas on other ranks (their errors name them)"
        if drift is not None:
            raise RuntimeError(f"--check-replicas: after update {self.progress.num_updates}, {drift}")


class _UpdateBatches(torch.utils.data.Dataset):
    """Item k: the micro-batches of the k-th update from ``start`` consumed samples on,
    with their token counts as host numbers (read here, on the host, before any device sees them)."""

    def __init__(self, data: Any, sampler: GlobalBatchSampler, start: int, pad: int):
        self.data, self.sampler, self.start, self.pad = data, sampler, start, pad

    def __getitem__(self, k: int) -> list[dict[str, Any]]:
        position = self.start + k * self.sampler.global_batch_size
        batches = []
        for pairs in self.sampler.local_micro_batches(position):
            batch = dict(self.data.collate(pairs))
            batch["target_count"] = int(batch["ntokens"])
            batch["input_count"] = int((batch["input_ids"] != self.pad).sum())
            batches.append(batch)
        return batches
