"""Reading a checkpoint offline, in one process with no process group (export, tools, tests).

``CheckpointReader(path)`` takes a checkpoint directory, a save dir (meaning its
``checkpoint_last``) or a file of the old single-file format. Tensors are read whole
from whatever shards hold them: one at a time for export, which so holds one tensor and
never the optimizer's; all at once for ``load`` (tests, small tools), which reads them
in one pass. Opening verifies every file against the checksums the save recorded (and
that the save wrote every file there), checks that no tensor's shape asks for more bytes
than its shards hold, so a tensor read whole is never larger than the checkpoint's files,
and every read checks that the directory is still the one opened: a run that replaces it
meanwhile (``checkpoint_last`` at its next save) would otherwise mix two updates.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distlm.checkpoint import compare, directory, integrity, legacy, storage
from distlm.checkpoint import meta as meta_file
from distlm.errors import UsageError

logger = logging.getLogger("distlm")


def resolve(path: str | Path) -> Path:
    """The checkpoint a path names: itself, or the last checkpoint of a save dir."""
    path = Path(path)
    if legacy.is_legacy(path) or directory.is_complete(path):
        return path
    if path.is_dir():
        for candidate in (path / directory.LAST, path / directory.LEGACY_LAST_FILE):
            if legacy.is_legacy(candidate) or directory.is_complete(candidate):
                return candidate
        # A checkpoint directory (or a save dir's checkpoint_last) with a metadata file missing.
        for damaged in (path, path / directory.LAST):
            present = [(damaged / name).is_file() for name in (directory.META_FILE, directory.DCP_METADATA_FILE)]
            if any(present) or damaged.name == directory.LAST and damaged.is_dir():
                missing = directory.META_FILE if not present[0] else directory.DCP_METADATA_FILE
                raise UsageError(f"{damaged} lacks {missing}; the checkpoint is incomplete")
        raise UsageError(f"{path} is neither a distlm checkpoint nor a save dir holding {directory.LAST}")
    raise UsageError(f"{path}: no such file")


class CheckpointReader:
    def __init__(self, path: str | Path, verify: bool = True):
        """``verify``: check every file against its recorded checksum first (a full read)."""
        self.path = resolve(path)
        self.is_legacy = legacy.is_legacy(self.path)
        self._identity = integrity.identity(self.path)
        if self.is_legacy:
            self.meta = legacy.read_meta(self.path)
            self._tensors: dict[str, TensorStorageMetadata] = {}
            return
        self.meta = meta_file.read(self.path)
        metadata = storage.read_metadata(self.path)
        self._tensors = {}
        for key, value in metadata.state_dict_metadata.items():
            if isinstance(value, TensorStorageMetadata):
                self._tensors[key] = value
            elif key.startswith("model."):
                storage.refuse_non_tensor(self.path, key)
        storage.check_shards_present(self.path, metadata)
        if verify:
            files = integrity.recorded_files(self.meta, self.path)
            problem = integrity.verify(self.path, files)
            if problem is not None:
                raise UsageError(f"{problem}; {integrity.remedy(self.path, self.meta, exporting=True)}")
            problem = integrity.unlisted(self.path, files)
            if problem is not None:
                raise UsageError(problem)
        else:
            logger.warning("%s: checksums not verified (--no-verify-checkpoint)", self.path)
        storage.check_tensor_sizes(self.path, metadata)
        self.check_unchanged()

    def check_unchanged(self) -> None:
        """Refuse to go on once the checkpoint directory was replaced since it was opened."""
        if integrity.identity(self.path) != self._identity:
            raise UsageError(f"{self.path} was replaced by a newer save while it was read (a run is saving into "
                             "its save dir); read it again, or name a numbered checkpoint that no save replaces")

    def keys(self) -> list[str]:
        """The full key of every tensor the checkpoint holds (model, optimizer, each rank's RNG)."""
        if self.is_legacy:
            state = legacy.read(self.path)
            return [f"model.{name}" for name in state["model"]] + [
                f"optimizer.{name}.{field}" for name, entry in state["optimizer"]["state"].items() for field in entry]
        return list(self._tensors)

    def model_names(self) -> list[str]:
        if self.is_legacy:
            return list(legacy.read(self.path)["model"])
        return [key.removeprefix("model.") for key in self._tensors if key.startswith("model.")]

    def check_model(self, built: dict[str, tuple[int, ...]], described: str) -> None:
        """Refuse, before any weight is read, a checkpoint whose model weights' names or shapes
        differ from ``built``'s (the model ``described``), as a resume refuses one that differs
        from the model it built."""
        saved = {name: tuple(self.tensor_spec(f"model.{name}")[0]) for name in self.model_names()}
        difference = compare.first_model_difference(saved, built)
        if difference is not None:
            raise UsageError(f"{self.path} does not hold the model {described}: {difference}; the checkpoint was "
                             "crafted or damaged; use a checkpoint you trust")

    def tensor_spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of one tensor, without reading it."""
        if self.is_legacy:
            tensor = self.tensor(key)
            return tensor.shape, tensor.dtype
        info = self._tensors.get(key)
        if info is None:
            raise UsageError(f"{self.path} holds no tensor {key}")
        return info.size, info.properties.dtype

    def tensor(self, key: str) -> torch.Tensor:
        """One tensor, whole, by its full key (``model.<name>``, ``optimizer.<name>.exp_avg``)."""
        if self.is_legacy:
            state = legacy.read(self.path)
            section, _, rest = key.partition(".")
            if section == "model":
                return state["model"][rest]
            name, _, field = rest.rpartition(".")
            return state["optimizer"]["state"][name][field]
        return self.tensors([key])[key]

    def tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Several whole tensors by full key, read together (one pass over the metadata, fewer reads)."""
        if self.is_legacy:
            return {key: self.tensor(key) for key in keys}
        state = {}
        for key in keys:
            info = self._tensors.get(key)
            if info is None:
                raise UsageError(f"{self.path} holds no tensor {key}")
            state[key] = torch.empty(info.size, dtype=info.properties.dtype)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
                storage.load(state, self.path, no_dist=True)
        except UsageError:
            raise
        # DCP reports a vanished or cut file as anything, wrapped in a CheckpointException,
        # which is not an Exception.
        except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001
            self.check_unchanged()
            raise UsageError(
                f"{self.path}: cannot be read ({storage.read_failure(err)}); the checkpoint is damaged") from None
        self.check_unchanged()
        return state

    def model_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor)`` for every model weight, one at a time."""
        for name in self.model_names():
            yield name, self.tensor(f"model.{name}")

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam's whole state by parameter name (reads every moment: for tests and tools)."""
        if self.is_legacy:
            return legacy.read(self.path)["optimizer"]["state"]
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in self.tensors([key for key in self._tensors if key.startswith("optimizer.")]).items():
            name, _, field = key.removeprefix("optimizer.").rpartition(".")
            state.setdefault(name, {})[field] = tensor
        return state


def load(path: str | Path) -> dict[str, Any]:
    """A whole checkpoint as one dict: its description, ``model`` and ``optimizer["state"]``
    by parameter name, ``num_updates`` and ``consumed_samples`` (for tests and small tools)."""
    reader = CheckpointReader(path)
    names = reader.model_names()
    model = reader.tensors([f"model.{name}" for name in names])
    return {
        **reader.meta,
        "model": {name: model[f"model.{name}"] for name in names},
        "optimizer": {"state": reader.optimizer_state()},
        "num_updates": reader.meta["progress"]["num_updates"],
        "consumed_samples": reader.meta["progress"]["consumed_samples"],
    }
