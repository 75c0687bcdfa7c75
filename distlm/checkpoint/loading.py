"""Loading a checkpoint into a run's Stateful objects, whatever layout wrote it.

A sharded checkpoint is verified against its recorded checksums, each rank a share of the
files: the shards' as the load reads them (verified_read.py), so a shard is read once, every
other file's before. Each rank reads only the slices its own shards need; a single-file
checkpoint of the old format is cut into this rank's shards. The model must be the one saved, unless
``--load-partial`` takes the weights both share. The reset flags (``--reset-optimizer``,
``--reset-meters``, ``--reset-dataloader``, ``--reset-lr-scheduler``) choose what starts
afresh, and a layout change reseeds dropout, since the saved RNG streams belong to the old one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from distlm.checkpoint import compare, integrity, legacy, storage
from distlm.checkpoint.resume import Resume
from distlm.checkpoint.stateful import (
    MODEL,
    OPTIMIZER,
    PROGRESS,
    RNG,
    SCALER,
    ModelState,
    OptimizerState,
    RNGState,
    TrainProgress,
    load_full_optimizer_state,
    seed_dropout,
)
from distlm.checkpoint.verified_read import VerifyingReader
from distlm.config import CheckpointConfig
from distlm.errors import UsageError
from distlm.runtime.agreement import data_files
from distlm.runtime.context import DistContext, describe_layout
from distlm.state.full import load_full_state_dict

logger = logging.getLogger("distlm")


class CheckpointLoader:
    """Loads a found checkpoint (``Resume``) into the states of this rank."""

    def __init__(self, settings: CheckpointConfig, ctx: DistContext):
        self.settings = settings
        self.ctx = ctx

    def load(self, resume: Resume, states: Mapping[str, Stateful], seed: int,
             config: dict[str, Any] | None = None) -> None:
        """Load ``resume`` into ``states`` (collective): the model's shards, and unless only
        the weights are wanted, every other state the checkpoint holds. ``config``, the
        run's settings, is compared with the checkpoint's and the changes logged."""
        settings = self.settings
        meta = resume.meta
        weights_only = resume.weights_only
        load_optimizer = not (weights_only or settings.reset_optimizer)
        same_layout = meta.get("world_size") == self.ctx.world_size and meta.get("layout") == self.ctx.layout
        skipped = {RNG} if not same_layout else set()
        if not load_optimizer:
            skipped |= {OPTIMIZER, SCALER}
        wanted = [MODEL] if weights_only else [key for key in states if key not in skipped]
        if config is not None and not weights_only:
            self._check_data(resume, config)
        if legacy.is_legacy(resume.path):
            loaded = self._load_legacy(resume.path, states, wanted)
        else:
            partial = weights_only and settings.load_partial
            loaded = self._load_sharded(resume.path, meta, states, wanted, partial=partial)
        for key in wanted:
            # States kept in distlm.json (the progress, the loss scaler, whatever holds no tensor).
            if key not in loaded and isinstance(meta.get(key), dict):
                states[key].load_state_dict(meta[key])
                loaded.add(key)
        progress: TrainProgress = states[PROGRESS]
        self._apply_resets(progress, load_optimizer, weights_only)
        if RNG not in loaded:
            # A rank's saved stream belongs to its old place in the layout: restored on a new
            # one, two tp ranks of one replica could draw different dropout masks (and two
            # replicas the same). Reseed by data-parallel rank, as a fresh run seeds.
            seed_dropout(seed, self.ctx.dp_rank, progress.num_updates)
            if not weights_only:
                logger.info(
                    "layout changed (world %s, %s -> world %d, %s): dropout RNG reseeded by data-parallel rank",
                    meta.get("world_size"), describe_layout(meta.get("layout")), self.ctx.world_size,
                    describe_layout(self.ctx.layout),
                )
        legacy.read.cache_clear()  # an old single-file checkpoint is read once, not kept for the run
        what = "weights of" if weights_only else "resumed from"
        logger.info("%s %s at update %d (%d samples consumed)", what, resume.path, progress.num_updates,
                    progress.consumed_samples)
        if config is not None and not weights_only and self.ctx.is_main:
            saved_layout = meta.get("layout")
            changes = compare.changed_settings(meta.get("config"), config,
                                               saved_layout.get("dp") if isinstance(saved_layout, dict) else None,
                                               self.ctx.dims.dp, progress.consumed_samples, progress.num_updates)
            if changes:
                logger.info("%s", changes)

    def _apply_resets(self, progress: TrainProgress, load_optimizer: bool, weights_only: bool) -> None:
        """The reset flags mean what they mean in fairseq. --reset-optimizer also restarts the
        update count (and with it the schedule); --reset-optimizer and --reset-meters drop
        the best validation value; --reset-lr-scheduler only skips the scheduler's own
        state, and distlm's schedules, like fairseq's polynomial_decay, inverse_sqrt and
        cosine, have none beyond the update count."""
        settings = self.settings
        if not load_optimizer:
            progress.load_state_dict({"consumed_samples": progress.consumed_samples})
        if settings.reset_meters:
            progress.best, progress.validations_without_improvement, progress.train_wall = None, 0, 0.0
        if settings.reset_dataloader:
            progress.consumed_samples = 0
        if settings.reset_lr_scheduler and not weights_only and self.ctx.is_main:
            restart = ("" if settings.reset_optimizer
                       else "; add --reset-optimizer to restart the count and the schedule")
            logger.info("--reset-lr-scheduler: the learning rate follows the update count (%d)%s, as in fairseq",
                        progress.num_updates, restart)

    def _check_data(self, resume: Resume, config: dict[str, Any]) -> None:
        """Refuse data replaced under the saved position, unless the data starts afresh (every rank the same)."""
        data = config.get("data", {}).get("data")
        changed = compare.data_difference(resume.meta.get("data_files"), data_files(data))
        if changed is None:
            return
        if not self.settings.reset_dataloader:
            consumed = (resume.meta.get("progress") or {}).get("consumed_samples")
            raise UsageError(f"--data {data}: {changed} since {resume.path} was saved, so its data position "
                             f"({consumed} samples consumed) would read other text; add --reset-dataloader to start "
                             "the data from its beginning, or restore the data the run was trained on")
        if self.ctx.is_main:
            logger.info("--data %s: %s since %s was saved; --reset-dataloader: the data starts from its beginning",
                        data, changed, resume.path)

    def _load_legacy(self, path: Path, states: Mapping[str, Stateful], wanted: list[str]) -> set[str]:
        """The old single-file format: whole tensors cut into this rank's shards."""
        state = legacy.read(path)
        model: ModelState = states[MODEL]
        built = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        difference = compare.first_model_difference({n: tuple(t.shape) for n, t in state["model"].items()}, built)
        if difference is not None:
            raise UsageError(f"{path} is a checkpoint of another model: {difference}; "
                             "build the model it was saved from (its settings are in the checkpoint's config)")
        load_full_state_dict(model.model, state["model"])
        loaded = {MODEL}
        if OPTIMIZER in wanted:
            optimizer: OptimizerState = states[OPTIMIZER]
            load_full_optimizer_state(optimizer.model, optimizer.optimizer, state["optimizer"]["state"])
            loaded.add(OPTIMIZER)
        if RNG in wanted and len(state["rng"]) == self.ctx.world_size:
            rng: RNGState = states[RNG]
            rng.load_state_dict({rng.key: state["rng"][self.ctx.rank]})
            loaded.add(RNG)
        return loaded

    def _load_sharded(self, path: Path, meta: dict[str, Any], states: Mapping[str, Stateful], wanted: list[str],
                      partial: bool) -> set[str]:
        """Load every wanted state the shards hold; returns their names."""
        saved = storage.read_metadata(path)
        storage.check_shards_present(path, saved)
        shards = self._verify(path, meta, saved)
        entries = saved.state_dict_metadata
        prefixes = _prefixes(entries)
        templates: dict[str, Any] = {}
        for key in wanted:
            if key not in prefixes:
                continue  # kept in distlm.json, or not in this checkpoint (a state registered since)
            template = states[key].state_dict()
            if key == MODEL:
                template = self._model_to_load(path, template, entries, partial)
            template = _present(template, key, entries, prefixes, path)
            if template:
                templates[key] = template
        reader = VerifyingReader(path, shards) if shards is not None else None
        failure = None
        try:
            with storage.single_process_quiet():
                storage.load(templates, path, no_dist=not self.ctx.is_distributed, reader=reader)
        except dcp.CheckpointException as err:
            failure = err
        if reader is not None:
            # A damaged file first: the read failure it may cause on another rank comes from it.
            problem = next((problem for problem in self.ctx.all_gather_object(reader.problem) if problem), None)
            if problem is not None:
                raise UsageError(f"{problem}; {integrity.remedy(path, meta)}")
        if failure is not None:
            raise UsageError(f"{path}: cannot be read ({storage.read_failure(failure)})") from None
        for key, state in templates.items():
            states[key].load_state_dict(state)
        return set(templates)

    def _model_to_load(self, path: Path, template: dict[str, Any], entries: dict[str, Any], partial: bool) -> dict:
        """The model's state to read: all of it, refused if the checkpoint's model differs,
        or with --load-partial the weights both share."""
        for key, md in entries.items():
            if key.startswith("model.") and isinstance(md, BytesStorageMetadata):
                storage.refuse_non_tensor(path, key)
        saved = {key.removeprefix("model."): tuple(md.size) for key, md in entries.items()
                 if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
        built = {name: tuple(tensor.shape) for name, tensor in template.items()}
        dims = self.ctx.dims
        if dims.pp_enabled:  # a pipeline rank holds its stages: the model is what the stages hold together
            parts: list[Any] = [None] * dims.pp
            dist.all_gather_object(parts, built, group=dims.pp_group(self.ctx.device.type))
            built = {name: shape for part in parts for name, shape in part.items()}
        difference = compare.first_model_difference(saved, built)
        if difference is None:
            return template
        if not partial:
            hint = ("add --load-partial to load the weights both share" if self.settings.finetune_from_model
                    else "build the model it was saved from (its settings are in the checkpoint's config), "
                         "or start from its weights with --finetune-from-model and --load-partial")
            raise UsageError(f"{path} is a checkpoint of another model: {difference}; {hint}")
        shared, left_out = compare.shared_weights(saved, built)
        if self.ctx.is_main:
            logger.info("--load-partial: %d weights loaded from %s, %d left out: %s", len(shared), path,
                        len(left_out), ", ".join(left_out))
        return {name: template[name] for name in shared if name in template}

    def _verify(self, path: Path, meta: dict[str, Any], saved: Metadata) -> dict[str, dict[str, Any]] | None:
        """Every file against what the save recorded, each rank a share, and no file there that
        the save did not write (collective). The shards' sizes only: their checksums are verified
        as the load reads them (verified_read.py), and their entries are returned for that;
        None with --no-verify-checkpoint."""
        if self.settings.no_verify_checkpoint:
            if self.ctx.is_main:
                logger.warning("%s: checksums not verified (--no-verify-checkpoint)", path)
            return None
        files = integrity.recorded_files(meta, path)
        shards = storage.shard_files(saved) & set(files)
        names = sorted(files)[self.ctx.rank::self.ctx.world_size]
        problem = (integrity.verify(path, files, [name for name in names if name in shards], contents=False)
                   or integrity.verify(path, files, [name for name in names if name not in shards]))
        if problem is not None:
            problem = f"{problem}; {integrity.remedy(path, meta)}"
        elif self.ctx.is_main:
            problem = integrity.unlisted(path, files)
        problems = [problem for problem in self.ctx.all_gather_object(problem) if problem is not None]
        if problems:
            raise UsageError(problems[0])
        return {name: files[name] for name in shards}


def _prefixes(entries: dict[str, Any]) -> set[str]:
    """Every dotted prefix of the checkpoint's keys (``optimizer``, ``optimizer.norm``, ...)."""
    found = set()
    for key in entries:
        parts = key.split(".")
        found.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    return found


def _present(value: Any, key: str, entries: dict[str, Any], prefixes: set[str], path: Path) -> Any:
    """``value`` (a state dict, nested) without what the checkpoint does not hold; None if
    none of it. A tensor the checkpoint holds as a non-tensor entry is refused."""
    if isinstance(value, dict):
        kept = {name: _present(item, f"{key}.{name}", entries, prefixes, path) for name, item in value.items()}
        return {name: item for name, item in kept.items() if item is not None} or None
    if key not in prefixes:
        return None
    if isinstance(value, torch.Tensor) and isinstance(entries.get(key), BytesStorageMetadata):
        storage.refuse_non_tensor(path, key)
    return value
