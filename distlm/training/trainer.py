"""Trainer: the loop (step, log, validate, save) over a model parallelised from outside.

The step itself, one update, is distlm/training/step.py. The data position is one global
count of consumed samples, so the next batch is known exactly after a resume. An update
costs one host synchronisation: the finite check of the gradient norm.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful

from distlm.checkpoint import BEST, Checkpointer, TrainProgress, seed_dropout, training_states
from distlm.config import TrainConfig
from distlm.data import SharedScan, load_split
from distlm.data.batches import training_sampler, update_batches
from distlm.models.loss import summed_cross_entropy
from distlm.observe.observer import Observer, check_observe_settings, start_log_file, stop_log_file
from distlm.observe.printer import significant
from distlm.optim import AdamWSettings, LRSchedule
from distlm.parallel.replicas import check_replicas
from distlm.precision import Precision
from distlm.runtime.agreement import check_ranks_agree
from distlm.runtime.context import DistContext
from distlm.runtime.signals import StopSignals
from distlm.state.names import unwrap
from distlm.training.builder import build_parallel_model, choose_vocabulary, resolve_model_spec
from distlm.training.evaluation import Validator, load_validation_subsets
from distlm.training.out_of_memory import STEP_REMEDY, describe_step_need, naming_out_of_memory
from distlm.training.precompile import CompileReport, precompile
from distlm.training.python_api import naming_config_fields, prepare_config
from distlm.training.run_description import describe_run, tokenizer_writer
from distlm.training.start_log import choose_document_attention, log_start, pipeline_stage_sizes
from distlm.training.startup import Start, start_run
from distlm.training.stats import TrainStats, run_stats
from distlm.training.step import Update, UpdateSettings

logger = logging.getLogger("distlm")


class Trainer:
    """``Trainer(config).fit()`` trains and returns the final metrics.

    ``model`` may be the user's own single-device module meeting the model contract
    (distlm/models/contract.py); ``train_data`` any object with ``__len__`` and
    ``collate(pairs) -> {"input_ids", "targets", "ntokens"}`` where ``pairs`` are
    ``(epoch, index)`` and targets are -100 where there is nothing to predict.
    By default both come from ``--arch`` and ``--data``. ``dist`` reuses a context
    from ``distlm.training.startup.start_run``. ``states``: more ``Stateful`` objects
    for the checkpoint to save and resume, by name.
    """

    @naming_config_fields
    def __init__(self, config: TrainConfig, model: torch.nn.Module | None = None, train_data: Any = None,
                 dist: DistContext | None = None, states: dict[str, Stateful] | None = None):
        self.config = prepare_config(config, model)
        check_observe_settings(config)
        start_log_file(config)  # the start-up lines go to --log-file too
        if dist is None:
            start = start_run(config, model)
        else:
            # A context the caller made may have checked another config: agree and resolve afresh.
            check_ranks_agree(config, dist.all_gather_object)
            start = Start(dist, None if model is not None else resolve_model_spec(config.model,
                                                                                  config.data.tokens_per_sample))
        self.ctx, self.spec = start.context, start.spec
        self.task = config.data.task or (model.task if model is not None else self.spec.task)
        self.arch = self.spec.name if model is None else type(model).__name__
        # Each rank checks the ids of its share of every split's file, and all learn every verdict.
        scan = SharedScan(self.ctx.rank, self.ctx.world_size, self.ctx.all_gather_object)
        # The data before the save dir: a run refused for its --data leaves no save dir or lock behind.
        self.data = train_data if train_data is not None else load_split(config, "train", self.task, None, scan)
        symbols = list(self.data.dictionary.symbols) if train_data is None else None
        subsets = load_validation_subsets(config, self.task, symbols, scan, train_data is not None, self.ctx.is_main)
        self.checkpointer = Checkpointer(config.checkpoint, self.ctx, self.arch, self.task)
        self.checkpointer.prepare()
        resume = self.checkpointer.find_resume()
        if resume is not None and resume.dictionary is not None and train_data is None:
            self.data.check_symbols(resume.dictionary)
        self.observer = Observer(config, self.ctx, resume.meta if resume is not None else None)
        self.precision = Precision.from_config(config.precision_mode, config.precision)
        dictionary = getattr(self.data, "dictionary", None)
        self.pad_id = dictionary.pad() if dictionary is not None else model.padding_idx
        vocabulary = choose_vocabulary(self.spec, dictionary, config.model) if model is None else None
        self.fixed_length = config.data.tokens_per_sample if (
            config.compile.compile or self.ctx.backend.static_shapes or self.ctx.dims.pp_enabled) else None
        """Batches padded to this length, so compiled or traced graphs (and pipeline stages) see one shape."""
        self.model, self.handle, self.model_inputs = build_parallel_model(
            config, self.ctx, self.spec, model, start.model, vocabulary.size if vocabulary else 0, self.pad_id,
            self.precision.param_dtype, self.task, resume is not None and not config.checkpoint.load_partial)
        self.pipeline = getattr(self.handle, "runner", None)  # pp > 1: the schedules (parallel/pipeline.py)
        log_start(self.ctx.is_main, self.data, self.model, self.spec if resume is None else None, config.seed,
                  vocabulary, pipeline_stage_sizes(self.model, self.ctx.dims, self.ctx.device.type))
        if config.data.document_mask:
            choose_document_attention(self.ctx.is_main, self.model, self.ctx.device,
                                      self.precision.autocast_dtype or self.precision.param_dtype)
        self.optimizer = self.handle.build_optimizer(AdamWSettings.from_config(config.optim), self.precision.param_dtype)
        self.sampler = training_sampler(config, self.data, self.ctx.dp_rank, self.ctx.dims.dp, self.fixed_length,
                                        self.ctx.is_main)
        self.validator = Validator(config, self.ctx, subsets, self.compute_loss, self.handle.loss_context,
                                   self.handle.local_loss, self.autocast, self.fixed_length,
                                   self.model_inputs.masked_positions, (self.data, self.sampler))
        self.schedule = LRSchedule(config.optim, updates_in_run=self.sampler.updates_in_epochs(config.optim.max_epoch))
        self.progress = TrainProgress()
        self.states = {**training_states(self.model, self.optimizer, self.precision.scaler, self.progress,
                                         self.ctx.rank), **(states or {})}
        """What a checkpoint holds, by name (``torch.distributed.checkpoint.stateful.Stateful`` objects)."""
        self.resumed_at: int | None = None
        """The update this run resumed at; None for a fresh start."""
        self.stop = StopSignals()
        """SIGTERM, SIGINT and SIGUSR1 while ``fit`` runs: every rank stops at one update and saves."""
        self.stop_saved: list[str] = []
        """The checkpoint names saved when a stop signal ended the run."""
        self.update = Update(
            self.ctx, self.model, self.handle, self.optimizer, self.precision, self.schedule, self.progress,
            self.sampler, self.stop, self.observer,
            UpdateSettings(config.optim.clip_norm, config.logging.log_interval, config.distributed.check_replicas),
            # Through the trainer, so that a subclass or test replacing one of its methods reaches the update.
            lambda batch: self.compute_loss(batch), lambda: self.autocast(), lambda: self.finished(), self.pipeline)
        """One update over this rank's micro-batches (distlm/training/step.py)."""
        if resume is not None:
            self.checkpointer.load(resume, self.states, config.seed, config.to_dict())
            self.resumed_at = self.progress.num_updates
        else:
            # Dropout differs per data-parallel replica, yet reproducibly; the tensor-parallel
            # ranks of one replica must draw the same masks in their replicated regions.
            seed_dropout(config.seed, self.ctx.dp_rank)

    # ----------------------------------------------------------------------- loop

    def update_batches(self) -> Iterator[list[dict[str, Any]]]:
        """This rank's micro-batches for each coming update, prepared by --num-workers processes."""
        return update_batches(self.data, self.sampler, self.progress.consumed_samples, self.pad_id,
                              self.config.data.num_workers, self.fixed_length, self.model_inputs.masked_positions)

    @naming_config_fields
    def fit(self) -> dict[str, Any]:
        self.stop.install()  # before the data workers start: they ignore the stop signals
        try:
            return self._fit()
        finally:
            self.stop.restore()
            stop_log_file()

    def _fit(self) -> dict[str, Any]:
        cfg = self.config
        printer = self.observer.start(self.resumed_at, self.stop)  # logs as the Printer does, and to trackers
        stats = run_stats(unwrap(self.model), cfg.data, self.task, self.ctx.device,
                          self.precision.autocast_dtype or self.precision.param_dtype, self.ctx.world_size)
        self.summary: dict[str, Any] = {}
        batches = self.update_batches()
        compiling = CompileReport(self.ctx.backend.compile_backend) if cfg.compile.compile and self.ctx.is_main else None
        stop = False
        try:
            while not (stop or self.finished()):
                # Everything one update does, collectives of logging and saving included.
                number = self.progress.num_updates + 1
                with self.ctx.naming_failed_collectives(number), naming_out_of_memory(
                        f"in update {number}", lambda: describe_step_need(self.model, self.ctx.dims, cfg), STEP_REMEDY), \
                        self.observer.update(number):
                    stop = self._run_update(self.observer.next_batch(batches), stats, printer)
                if compiling is not None:
                    compiling.log()
                    compiling = None
            with self.ctx.naming_failed_collectives(self.progress.num_updates):
                self.handle.wait_pending()
                self.checkpointer.wait()
        finally:
            printer.close()
            self.checkpointer.close()
        with self.ctx.naming_failed_collectives(self.progress.num_updates):
            final = {**self.summary, **stats.summary_rates(), "update": self.progress.num_updates,
                     "consumed_samples": self.progress.consumed_samples,
                     "train_wall": significant(self.progress.train_wall, 5),
                     "memory_bytes_per_rank": self.ctx.all_gather_object(self.last_memory)}
            if self.stop.agreed:
                final["stopped_by"] = self.stop.describe()
            printer.log(final, kind="summary")
            self.checkpointer.announce_last()
            self.ctx.close()
        return final

    def _run_update(self, micro_batches: list[dict[str, Any]], stats: TrainStats, printer: Observer) -> bool:
        """Train, log, validate and save what one update calls for; True to stop early."""
        started = time.perf_counter()
        epoch_before = self.sampler.epoch_of(self.progress.consumed_samples)
        with self.observer.computing():
            record = self.train_step(micro_batches)
        self.progress.train_wall += time.perf_counter() - started
        applied = record.pop("applied")
        stats.add(record.pop("loss_sum"), record.pop("target_tokens"), record.pop("input_tokens"),
                  record.pop("samples"), record.pop("batch_tokens"), record.pop("attention_pairs", None))
        printer.progress()
        # The first line comes at the run's first update (as torchtitan's at step 1): a user sees
        # the loss within seconds, not after --log-interval updates.
        due = self.progress.num_updates % self.config.logging.log_interval == 0 or stats.first is None
        if (applied and due) or self.finished():
            self.summary = {"update": self.progress.num_updates, **stats.reduce(self.ctx.dp_group), **record,
                            "gnorm": significant(record["gnorm"], 5),
                            "train_wall": significant(self.progress.train_wall, 5),
                            **self.observer.interval_fields()}
            printer.log(self.summary)
            stats.reset()
        ended = epoch_before + 1 if self.sampler.epoch_of(self.progress.consumed_samples) > epoch_before else None
        if self.stop.agreed:
            # Cadence aside, and no validation: the time left may be short.
            self.stop_saved = self.checkpointer.due(self.progress.num_updates, ended, done=True)
            self.save_checkpoint(self.stop_saved)
            return True
        if applied or ended is not None or self.finished():
            return self._validate_and_save(ended, printer)
        return False

    def precompile(self) -> str:
        """``--precompile``: fill the compile cache with every graph a run needs, save nothing."""
        line = precompile(self)
        self.checkpointer.close()
        self.handle.wait_pending()
        self.ctx.close()
        return line

    def _validate_and_save(self, end_of_epoch: int | None, printer: Observer) -> bool:
        """Validate and save what is due after an update; True when patience has run out."""
        done, stop, improved = self.finished(), False, False
        if self.validator.due(self.progress.num_updates, end_of_epoch, done):
            with self.ctx.naming_failed_collectives(self.progress.num_updates):
                results = self.validator.validate(self.model)
            improved = self.validator.record(results, self.progress)
            for line in self.validator.log_records(results, self.progress):
                printer.log(line, kind="valid")
            stop = self.validator.out_of_patience(self.progress)
        names = self.checkpointer.due(self.progress.num_updates, end_of_epoch, done or stop)
        self.save_checkpoint(names + ([BEST] if improved and self.checkpointer.enabled else []))
        return stop

    def save_checkpoint(self, names: list[str] | None = None) -> None:
        """Save now (collective); by default ``checkpoint_last``, as at the end of a run."""
        names = self.checkpointer.due(self.progress.num_updates, None, done=True) if names is None else names
        if not names:
            return
        # In-flight gradients are not saved: a resumed run refills the pipeline with one
        # update that applies nothing, as the first update of any run does.
        self.handle.wait_pending()
        self.checkpointer.save(names, self.states,
                               describe_run(self.config, self.data, self.model, self.spec, self.observer.run_ids()),
                               tokenizer_writer(self.data, self.task))

    def finished(self) -> bool:
        """Whether the run is over: --max-update updates applied, or --max-epoch epochs consumed."""
        cfg = self.config.optim
        if cfg.max_update and self.progress.num_updates >= cfg.max_update:
            return True
        return bool(cfg.max_epoch) and self.progress.consumed_samples >= cfg.max_epoch * self.sampler.num_samples

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """One update over this rank's ``--update-freq`` micro-batches (distlm/training/step.py)."""
        return self.update(micro_batches)

    @property
    def last_memory(self) -> dict[str, int]:
        """Bytes this rank held at the last logged update."""
        return self.update.last_memory

    def stop_line(self) -> str:
        """After ``fit`` ended on a stop signal: what stopped it, where, and what was saved."""
        return self.stop.describe_stop(self.progress.num_updates, self.checkpointer.save_dir,
                                       self.stop_saved if self.checkpointer.enabled else None)

    def autocast(self):
        """Mixed precision for forward; none where the strategy casts itself (FSDP's policy)."""
        return self.precision.autocast(self.ctx.backend.autocast_device_type,
                                       enabled=not self.handle.mixed_precision_by_strategy)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed cross-entropy over the batch's targets (divided by the global count in train_step)."""
        if self.pipeline is not None:
            return self.pipeline.eval_loss(batch)
        return summed_cross_entropy(self.model, batch, self.model_inputs)

    @property
    def num_updates(self) -> int:
        """Updates applied so far (skipped ones do not count)."""
        return self.progress.num_updates

    @property
    def consumed_samples(self) -> int:
        """Global position in the training data: samples of every rank consumed so far."""
        return self.progress.consumed_samples

    def check_replicas(self) -> None:
        """``--check-replicas``: every copy of a parameter is bit-identical after every update."""
        check_replicas(self.model, self.ctx, self.progress.num_updates)
