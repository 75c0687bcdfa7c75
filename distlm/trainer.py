"""Trainer: build -> parallelize -> loop -> checkpoint.

One update is: ``--update-freq`` micro-batches, gradients synchronised on the last
only; the summed loss divided once by the global number of target tokens; unscale,
clip, finite check, step, learning rate. The data position is one global count of
consumed samples, so the next batch is known exactly after a resume.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import logging
import math
import time
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from distlm import checkpoint
from distlm.backends.registry import get_backend
from distlm.config import TrainConfig, validate
from distlm.data import GlobalBatchSampler, load_lm_data
from distlm.data.dictionary import Dictionary
from distlm.env import ClusterEnv, ExplicitLaunch, resolve_master_via_mpi
from distlm.errors import UsageError
from distlm.mesh import ParallelDims
from distlm.metrics import TrainStats, Printer
from distlm.models import arch_config, arch_task, build_model
from distlm.optim import LRSchedule, build_optimizer
from distlm.memory import memory_report
from distlm.parallel.api import build_comm_hook, check_strategy, gradient_sync, parallelize
from distlm.parallel.fsdp import check_cpu_offload
from distlm.parallel.tp import clip_grad_norm_ as tp_clip_grad_norm_
from distlm.parallel.tp import local_value, loss_context, validate_tp
from distlm.parallel.zero1 import build_zero1_optimizer
from distlm.precision import Precision, grads_are_finite

logger = logging.getLogger("distlm")


class CollectiveFailure(RuntimeError):
    """A collective did not complete: a peer died, stalled past --timeout-sec, or lost its link."""


class Trainer:
    """``Trainer(config).fit()`` trains and returns the final metrics.

    ``model`` may be any single-device module mapping ``input_ids [B, T]`` to logits
    ``[B, T, V]``; ``train_data`` any object with ``__len__`` and
    ``collate(pairs) -> {"input_ids", "targets", "ntokens"}`` where ``pairs`` are
    ``(epoch, index)`` and targets are -100 where there is nothing to predict.
    By default both come from ``--arch`` and ``--data``.
    """

    def __init__(self, config: TrainConfig, model: torch.nn.Module | None = None, train_data: Any = None):
        validate(config)
        if model is None:
            arch_task(config.model.arch)  # an unknown --arch fails before any rendezvous or data loading
        self.config = config
        dist_cfg = config.distributed
        self.env = ClusterEnv.detect(
            explicit=ExplicitLaunch(
                world_size=dist_cfg.distributed_world_size,
                rank=dist_cfg.distributed_rank,
                init_method=dist_cfg.distributed_init_method,
            )
        )
        if self.env.launcher == "mpi" and self.env.is_distributed:
            self.env = resolve_master_via_mpi(self.env)  # mpiexec exports no master address
        self.is_main = self.env.rank == 0
        self.backend = get_backend(dist_cfg.device)
        self.backend.setup(self.env, config.precision_mode, dist_cfg.network)
        self.device = self.backend.device(self.env)
        self.dims = ParallelDims(
            world_size=self.env.world_size, dp=dist_cfg.dp_degree, tp=dist_cfg.tp_degree, strategy=dist_cfg.strategy
        )
        check_strategy(dist_cfg, self.dims)
        if dist_cfg.check_replicas and dist_cfg.strategy == "fsdp" and self.dims.dp_enabled and not self.dims.tp_enabled:
            logger.info("--check-replicas: FSDP shards every parameter, so no rank holds a copy to compare")
        check_cpu_offload(dist_cfg.cpu_offload, self.backend.name)
        if model is None and self.dims.tp_enabled:
            # A tp degree that cannot split the named arch fails before any rendezvous.
            validate_tp(arch_config(config.model.arch), self.dims.tp, sequence_parallel=dist_cfg.sequence_parallel,
                        tokens_per_sample=config.data.tokens_per_sample, arch=config.model.arch)
        if self.env.world_size > 1 and not dist.is_initialized():
            # An existing process group (the caller's own, or an earlier Trainer's) is reused.
            self.backend.init_process_group(self.env, datetime.timedelta(seconds=dist_cfg.timeout_sec))
        self.dp_group = self.dims.dp_group(self.device.type)
        self.dp_rank, _ = self.dims.coordinates(self.env.rank)
        if dist_cfg.fast_stat_sync:
            logger.info("--fast-stat-sync: accepted; distlm always reduces its statistics in one collective")

        self.task = config.data.task or (arch_task(config.model.arch) if model is None else "causal_lm")
        self.arch = config.model.arch if model is None else type(model).__name__
        resume_file = None if config.checkpoint.no_save else checkpoint.resume_path(config.checkpoint.save_dir)
        self._check_every_rank_sees(resume_file)
        self.resume_state = checkpoint.load(resume_file) if resume_file else None
        if self.resume_state is not None:
            checkpoint.check_resumable(self.resume_state, resume_file, self.arch, self.task)

        self._user_model = model
        self.data = train_data if train_data is not None else self._load_data()
        self.precision = Precision.from_mode(
            config.precision_mode,
            config.precision.fp16_init_scale,
            config.precision.fp16_scale_window,
            config.precision.min_loss_scale,
        )
        self.model = self._build_model(model)
        self.comm_hook = None
        if self.dims.dp_enabled and dist_cfg.strategy in ("ddp", "zero1"):
            ranks_per_node = dist_cfg.ranks_per_node or self.env.local_world_size
            self.comm_hook = build_comm_hook(dist_cfg, self.dims, ranks_per_node, self.device.type)
        elif dist_cfg.comm_hook != "allreduce" or dist_cfg.double_buffering or dist_cfg.comm_transport != "torch":
            logger.info("one data-parallel replica: no gradient all-reduce, so the comm hook settings do nothing")
        if self.dims.tp_enabled and model is not None:  # a named arch was checked before the rendezvous
            validate_tp(self.model, self.dims.tp, sequence_parallel=dist_cfg.sequence_parallel,
                        tokens_per_sample=config.data.tokens_per_sample, arch=self.arch)
        self.model = parallelize(
            self.model, self.dims, dist_cfg, self.device, self.comm_hook, precision_mode=config.precision_mode,
            whole_model=self._whole_initialised_model_on_cpu if self._shards_materialised_later else None,
        )
        self._inflight_loss_scale = 1.0
        if dist_cfg.strategy == "zero1":
            self.optimizer = build_zero1_optimizer(
                self.model.parameters(), config.optim, self.dp_group, self.precision.param_dtype,
                sync_bucket_mb=dist_cfg.bucket_cap_mb,
            )
        else:
            self.optimizer = build_optimizer(self.model.parameters(), config.optim, self.precision.param_dtype)
        self.sampler = GlobalBatchSampler(
            num_samples=len(self.data),
            micro_batch_size=config.data.batch_size,
            update_freq=config.data.update_freq,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp,
            seed=config.seed,
        )
        epoch_updates = math.ceil(config.optim.max_epoch * len(self.data) / self.sampler.global_batch_size)
        self.schedule = LRSchedule(config.optim, updates_in_run=epoch_updates)
        if self.sampler.global_batch_size > len(self.data):
            raise UsageError(
                f"the global batch (--batch-size {config.data.batch_size} x --update-freq {config.data.update_freq} "
                f"x {self.dims.dp} replicas = {self.sampler.global_batch_size}) exceeds the {len(self.data)} "
                "training samples; lower --batch-size or --update-freq, or use fewer ranks"
            )
        self.num_updates = 0
        self.consumed_samples = 0
        self.last_memory: dict[str, int] = {}
        if self.resume_state is not None:
            self._restore(self.resume_state, resume_file)
        else:
            # Dropout differs per data-parallel replica, yet reproducibly; the tensor-parallel
            # ranks of one replica must draw the same masks in their replicated regions.
            torch.manual_seed(config.seed * 1000 + self.dp_rank)

    # ----------------------------------------------------------------------- build

    def _load_data(self):
        dictionary = None
        if self.resume_state is not None:
            dictionary = Dictionary.from_symbols(self.resume_state["dictionary"])
        return load_lm_data(
            self.config.data.data,
            split="train",
            task=self.task,
            tokens_per_sample=self.config.data.tokens_per_sample,
            sample_break_mode=self.config.data.sample_break_mode,
            seed=self.config.seed,
            mask_prob=self.config.data.mask_prob,
            dictionary=dictionary,
        )

    def _build_model(self, model: torch.nn.Module | None) -> torch.nn.Module:
        """The user's model, or the named arch: initialised whole here, or left on the meta
        device when a sharded strategy will materialise only its own shards (see
        ``parallel.api.materialise``)."""
        cfg = self.config
        if model is None:
            model = self._new_arch_model()
            if cfg.data.tokens_per_sample > model.max_positions:
                raise UsageError(
                    f"--tokens-per-sample {cfg.data.tokens_per_sample} exceeds --arch {cfg.model.arch}'s "
                    f"maximum of {model.max_positions} positions; lower --tokens-per-sample"
                )
            if not self._shards_materialised_later:
                model = self._initialised(model, self.device)
        self.uses_masked_tokens = self.task == "masked_lm" and "masked_tokens" in _forward_params(model)
        if self._shards_materialised_later:
            return model.to(dtype=self.precision.param_dtype)  # still meta: no memory yet
        return model.to(device=self.device, dtype=self.precision.param_dtype)

    @property
    def _shards_materialised_later(self) -> bool:
        """Whether the named arch stays on meta until parallelism has cut it into shards:
        under FSDP or tensor parallel no rank but 0 ever holds the whole model."""
        sharded = (self.dims.strategy == "fsdp" and self.dims.dp_enabled) or self.dims.tp_enabled
        return sharded and self.config.model.arch is not None and self._user_model is None

    def _new_arch_model(self) -> torch.nn.Module:
        """The named arch on the meta device (no memory, no RNG drawn)."""
        cfg = self.config
        overrides = {
            k: v for k, v in (("dropout", cfg.model.dropout), ("attention_dropout", cfg.model.attention_dropout)) if v is not None
        }
        dictionary = self.data.dictionary
        with torch.device("meta"):
            return build_model(cfg.model.arch, vocab_size=len(dictionary), padding_idx=dictionary.pad(), **overrides)

    def _initialised(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Materialise a meta model whole on ``device`` and initialise it from the seed."""
        model.to_empty(device=device)
        torch.manual_seed(self.config.seed)  # identical initial weights on every rank, and in one process
        with torch.no_grad():
            model.init_weights()
        return model

    def _whole_initialised_model_on_cpu(self) -> torch.nn.Module:
        """What one process would train from (rank 0 builds it to fill the others' shards)."""
        return self._initialised(self._new_arch_model(), torch.device("cpu")).to(dtype=self.precision.param_dtype)

    # ----------------------------------------------------------------- checkpoint

    def _check_every_rank_sees(self, resume_file) -> None:
        """Every rank resumes or none does (collective).

        Rank 0 writes the checkpoint and every rank reads it, so a --save-dir on a
        node-local disk is visible to some ranks only. Those would resume while the
        others started afresh, and their collectives would no longer match: a hang.
        """
        if self.env.world_size == 1:
            return
        seen = [None] * self.env.world_size
        dist.all_gather_object(seen, resume_file is not None)
        if len(set(seen)) > 1:
            sees = [rank for rank, found in enumerate(seen) if found]
            raise UsageError(
                f"--save-dir {self.config.checkpoint.save_dir}: {checkpoint.LAST} is there on ranks {sees} only; "
                "put --save-dir on a file system that every rank shares"
            )

    def _checkpoint_state(self) -> dict[str, Any]:
        rng = checkpoint.capture_rng()
        rng_by_rank = [rng]
        if self.env.world_size > 1:
            rng_by_rank = [None] * self.env.world_size
            dist.all_gather_object(rng_by_rank, rng)
        dictionary = getattr(self.data, "dictionary", None)
        model_state, optimizer_state = checkpoint.gather_train_state(self.model, self.optimizer)
        return {
            "arch": self.arch,
            "task": self.task,
            "config": self.config.to_dict(),
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": {"num_updates": self.num_updates},
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None,
            "rng": rng_by_rank,
            "world_size": self.env.world_size,
            "layout": self._layout,
            "num_updates": self.num_updates,
            "consumed_samples": self.consumed_samples,
            "dictionary": list(dictionary.symbols) if dictionary is not None else None,
        }

    def save_checkpoint(self) -> None:
        if self._double_buffered:
            # In-flight gradients are not saved: a resumed run refills the pipeline with
            # one update that applies nothing, as the first update of any run does.
            self.comm_hook[1].wait_pending()
        if self.config.checkpoint.no_save:
            return
        state = self._checkpoint_state()  # collective: every rank takes part
        if self.is_main:
            names = [checkpoint.LAST]
            interval = self.config.checkpoint.save_interval_updates
            if interval and self.num_updates % interval == 0:
                names.append(checkpoint.numbered(self.num_updates))
            checkpoint.save(state, self.config.checkpoint.save_dir, names)
        if self.dp_group is not None:
            dist.barrier()  # nobody resumes or exits before the file is complete

    def _restore(self, state: dict[str, Any], path) -> None:
        checkpoint.load_train_state(self.model, self.optimizer, state["model"], state["optimizer"])
        if self.precision.scaler is not None and state["scaler"] is not None:
            self.precision.scaler.load_state_dict(state["scaler"])
        self.num_updates = state["num_updates"]
        self.consumed_samples = state["consumed_samples"]
        # Checkpoints from before tensor parallel existed hold only the world size: all data parallel.
        saved_layout = state.get("layout", {"dp": state["world_size"], "tp": 1})
        if state["world_size"] == self.env.world_size and saved_layout == self._layout:
            checkpoint.restore_rng(state["rng"][self.env.rank])
        else:
            # A rank's saved stream belongs to its old place in the layout: restored on a new
            # one, two tp ranks of one replica could draw different dropout masks (and two
            # replicas the same). Reseed by data-parallel rank, as a fresh run seeds.
            torch.manual_seed(self.config.seed * 1000 + self.dp_rank + 7919 * self.num_updates)
            logger.info("layout changed (world %d, %s -> world %d, %s): dropout RNG reseeded by data-parallel rank",
                        state["world_size"], saved_layout, self.env.world_size, self._layout)
        logger.info("resumed from %s at update %d (%d samples consumed)", path, self.num_updates, self.consumed_samples)

    @property
    def _layout(self) -> dict[str, int]:
        return {"dp": self.dims.dp, "tp": self.dims.tp}

    # ----------------------------------------------------------------------- loop

    def update_batches(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        """This rank's micro-batches for each coming update, prepared by --num-workers processes."""
        dataset = _UpdateBatches(self.data, self.sampler, self.consumed_samples)
        if self.config.data.num_workers == 0:
            return map(dataset.__getitem__, itertools.count())
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, sampler=itertools.count(), num_workers=self.config.data.num_workers
        )
        return iter(loader)

    def fit(self) -> dict[str, Any]:
        cfg = self.config
        printer = Printer(cfg.logging.log_format, cfg.optim.max_update or None, self.is_main)
        stats = TrainStats()
        train_wall = 0.0
        summary: dict[str, Any] = {}
        batches = self.update_batches()
        try:
            while not self._done():
                started = time.perf_counter()
                with self._naming_ranks_on_collective_failure():
                    record = self.train_step(next(batches))
                train_wall += time.perf_counter() - started
                stats.add(record.pop("loss_sum"), record.pop("target_tokens"), record.pop("input_tokens"), record.pop("samples"))
                printer.progress()
                if self.num_updates % cfg.logging.log_interval == 0 or self._done():
                    summary = {
                        "update": self.num_updates,
                        **stats.reduce(self.dp_group),
                        **record,
                        "gnorm": round(record["gnorm"], 3),
                        "train_wall": round(train_wall, 2),
                    }
                    printer.log(summary)
                    stats.reset()
                interval = cfg.checkpoint.save_interval_updates
                if interval and self.num_updates % interval == 0 and not self._done():
                    self.save_checkpoint()
        finally:
            printer.close()
        self.save_checkpoint()
        final = {
            **summary,
            "update": self.num_updates,
            "consumed_samples": self.consumed_samples,
            "train_wall": round(train_wall, 2),
            "memory_bytes_per_rank": self._memory_by_rank(),
        }
        printer.log(final, kind="summary")
        self._let_collectives_finish()
        return final

    def _let_collectives_finish(self) -> None:
        """Let gloo's worker thread release the last collective before the process may exit.

        gloo's worker thread drops its reference to a finished collective after ``wait()``
        has returned here, and releasing tensors created in Python takes the GIL. If the
        interpreter is already shutting down, that thread is killed inside a C++
        destructor and the process aborts ("terminate called without an active
        exception"): 3 of 39 two-rank FSDP test runs ending in all_gather_object, 0 of 39
        with this barrier. It blocks with the GIL released until every rank arrives,
        which lets that thread finish (likely, not guaranteed); the barrier's own work
        holds no Python tensors. ``distlm.train.exit_without_teardown`` closes the rest
        of the window for the command line.
        """
        if self.env.world_size > 1:
            dist.barrier()

    def _memory_by_rank(self) -> list[dict[str, int]]:
        """Bytes in parameters, gradients and optimizer state, measured on each rank's own tensors."""
        mine = self.last_memory
        if self.env.world_size == 1:
            return [mine]
        everyone = [None] * self.env.world_size
        dist.all_gather_object(everyone, mine)
        return everyone

    @contextlib.contextmanager
    def _naming_ranks_on_collective_failure(self) -> Iterator[None]:
        """Turn torch's transport-level error into one line naming the group and the timeout."""
        try:
            yield
        except RuntimeError as err:
            cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            transport = isinstance(err, dist.DistError) or any(
                word in cause.lower() for word in ("timed out", "timeout", "connection", "gloo", "nccl")
            )
            if self.env.world_size == 1 or not transport:
                raise
            # An update's collectives span the dp group (the token count, DDP/FSDP), the tp
            # group (tensor parallel) and the world (--check-replicas), so the ranks that
            # may be missing are all of them.
            ranks = list(range(self.env.world_size))
            raise CollectiveFailure(
                f"rank {self.env.rank}: a collective of update {self.num_updates + 1} among ranks {ranks} "
                f"did not complete (--timeout-sec {self.config.distributed.timeout_sec:g}): {cause}. "
                "Another rank probably died or stalled; its own log says why."
            ) from err

    def _done(self) -> bool:
        cfg = self.config.optim
        if cfg.max_update and self.num_updates >= cfg.max_update:
            return True
        return bool(cfg.max_epoch) and self.consumed_samples >= cfg.max_epoch * len(self.data)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One update over this rank's ``--update-freq`` micro-batches."""
        micro_batches = [{k: v.to(self.device) for k, v in b.items()} for b in micro_batches]
        local_targets = sum(int(b["ntokens"]) for b in micro_batches)
        global_targets = self._global_sum(local_targets)
        # DDP averages gradients over replicas; multiplying by their number makes the
        # result the gradient of (summed loss / global target tokens): normalised once.
        scale = self.dims.dp * self.precision.loss_scale / max(global_targets, 1)
        # With double buffering the gradients that come back now were scaled one update ago.
        gradient_loss_scale = self._inflight_loss_scale if self._double_buffered else self.precision.loss_scale
        self._inflight_loss_scale = self.precision.loss_scale

        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with gradient_sync(self.model, enabled=last), loss_context(self.model):
                with self.precision.autocast(self.backend.autocast_device_type):
                    loss = self._loss_sum(batch)
                (loss * scale).backward()
            loss_sum += local_value(loss.detach()).double().cpu()

        lr = self.schedule.apply(self.optimizer, self.num_updates + 1)
        # Under tensor parallel without a data-parallel wrapper, parameters outside the plan
        # (norms) stay plain tensors beside DTensors; torch's foreach kernels refuse such
        # mixed lists unless the plain ones are taken as replicated, which they are.
        with implicit_replication() if self.dims.tp_enabled else contextlib.nullcontext():
            gnorm = self._unscale_and_clip(gradient_loss_scale)
            overflow = not grads_are_finite(gnorm)
            pipeline_filling = self._double_buffer_filling()
            if overflow:
                logger.info("update %d: gradient overflow at loss scale %g, update skipped", self.num_updates + 1, self.precision.loss_scale)
            elif pipeline_filling:
                logger.info("double buffering: the first update's gradients are still in flight; it applies no update")
            else:
                self.backend.optimizer_step(self.optimizer)
                self.num_updates += 1
        if self.precision.scaler is not None:
            self.precision.scaler.update(overflow)
        self.consumed_samples += self.sampler.global_batch_size  # before _done(), which --max-epoch reads
        if self._done() or self.num_updates % self.config.logging.log_interval == 0:
            # Measured while gradients still exist: zero_grad below frees them.
            self.last_memory = memory_report(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.mark_step()
        if self.config.distributed.check_replicas:
            self.check_replicas()

        record = {
            "loss_sum": loss_sum,
            "target_tokens": local_targets,
            "input_tokens": sum(int((b["input_ids"] != self._pad).sum()) for b in micro_batches),
            "samples": sum(len(b["input_ids"]) for b in micro_batches),
            "lr": float(f"{lr:.6g}"),
            "gnorm": float(gnorm),
        }
        if self.precision.scaler is not None:
            record["loss_scale"] = self.precision.loss_scale
        return record

    @property
    def _double_buffered(self) -> bool:
        return self.comm_hook is not None and self.comm_hook[1] is not None

    def _double_buffer_filling(self) -> bool:
        """True on the first update with double buffering, whose gradients are not back yet."""
        return self._double_buffered and self.comm_hook[1].first_step

    @property
    def _pad(self) -> int:
        dictionary = getattr(self.data, "dictionary", None)
        return dictionary.pad() if dictionary is not None else -1

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed cross-entropy (fp32) over the batch's target tokens."""
        targets = batch["targets"]
        if self.uses_masked_tokens:
            masked = targets.ne(-100)
            logits = self.model(batch["input_ids"], masked_tokens=masked)
            targets = targets[masked]
        else:
            logits = self.model(batch["input_ids"])
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )

    def _global_sum(self, value: int) -> int:
        if self.dp_group is None:
            return value
        total = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.dp_group)
        return int(total.item())

    def _unscale_and_clip(self, loss_scale: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if loss_scale != 1.0:
            torch._foreach_mul_([p.grad for p in params], 1.0 / loss_scale)
        max_norm = self.config.optim.clip_norm or math.inf
        # tp's version groups gradients by device mesh (embeddings on dp, layers on dp x tp),
        # which torch's own refuses to mix; without tensor parallel they are the same.
        clip = tp_clip_grad_norm_ if self.dims.tp_enabled else torch.nn.utils.clip_grad_norm_
        return clip(params, max_norm, foreach=True)

    # ---------------------------------------------------------------------- debug

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Every copy of a parameter must be bit-identical after every update.

        Copies live on the ranks of the data-parallel group (unless FSDP shards it, by
        design) and, for whatever tensor parallel leaves whole (norms, RoBERTa's
        embeddings, replicated DTensors), on the ranks of the tensor-parallel group.
        """
        params = list(self.model.parameters())
        names = checkpoint.parameter_names(self.model)
        drifts = []
        if self.dims.dp_enabled and self.dims.replicas_share_parameters:
            drifts.append(_first_difference(params, names, self.dp_group, "data-parallel"))
        if self.dims.tp_enabled:
            whole = [i for i, p in enumerate(params) if not _sharded_on(p, "tp")]
            drifts.append(_first_difference([params[i] for i in whole], [names[i] for i in whole],
                                            self.dims.tp_group(self.device.type), "tensor-parallel"))
        drift = next((d for d in drifts if d is not None), None)
        if drifts and self.env.world_size > 1:  # the same decision on every rank: it depends on dims only
            # A drift is seen only inside the group holding it; every rank must stop
            # together, or the others wait for it in the next collective until the timeout.
            found = torch.tensor([drift is not None], dtype=torch.int64, device=self.device)
            dist.all_reduce(found)
            if found.item() and drift is None:
                drift = "parameters differ between replicas on other ranks (their errors name them)"
        if drift is not None:
            raise RuntimeError(f"--check-replicas: after update {self.num_updates}, {drift}")


def _sharded_on(param: torch.Tensor, mesh_dim: str) -> bool:
    """Whether a (DTensor) parameter is split along the named mesh dimension."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return mesh_dim in names and param.placements[names.index(mesh_dim)].is_shard()


def _first_difference(params: list[torch.Tensor], names: list[str], group, kind: str) -> str | None:
    """Which parameter's local tensor differs across ``group``, and between which ranks;
    None if all copies are bit-identical (collective over ``group``)."""
    if not params:
        return None
    mine = torch.stack([_bitwise_digest(p) for p in params]).cpu()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    for rank, theirs in zip(ranks, gathered):
        differs = (theirs != gathered[0]).any(dim=1).nonzero()
        if len(differs):
            return f"parameter {names[int(differs[0])]} differs between {kind} ranks {ranks[0]} and {rank}"
    return None


def _bitwise_digest(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of the tensor's bits: their plain sum and a position-weighted sum.

    Comparing bits (not float sums) catches differences that cancel numerically, and
    the weights catch elements that merely swapped places.
    """
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()  # tensor-parallel shards: compared with the same shard of other replicas
    flat = tensor.detach().contiguous().view(-1)
    word = torch.int32 if flat.element_size() == 4 else torch.int16 if flat.element_size() == 2 else torch.int64
    bits = flat.view(word).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack([bits.sum(), (bits * weights).sum()])


class _UpdateBatches(torch.utils.data.Dataset):
    """Item k: the micro-batches of the k-th update from ``start`` consumed samples on."""

    def __init__(self, data: Any, sampler: GlobalBatchSampler, start: int):
        self.data, self.sampler, self.start = data, sampler, start

    def __getitem__(self, k: int) -> list[dict[str, torch.Tensor]]:
        position = self.start + k * self.sampler.global_batch_size
        return [self.data.collate(pairs) for pairs in self.sampler.local_micro_batches(position)]


def _forward_params(model: torch.nn.Module) -> Sequence[str]:
    return tuple(inspect.signature(model.forward).parameters)
