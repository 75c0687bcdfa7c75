"""What a run records about itself: enough to export a checkpoint and to reproduce a number.

``distlm.json`` gets the command-line config, the dictionary, tied weight names, the
model's config and family, for a Hugging Face model its special token ids, the
trackers' run ids and the data files' fingerprints; the checkpoint directory gets the tokenizer as Hugging Face files.
``run.json``, beside the checkpoints (and the scaling suite's results), says what ran
where: distlm's version and commit, torch and backend versions, the resolved config,
the launcher and layout, the hardware and the communication environment variables.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any, Callable

import torch

from torch import nn

from distlm.agreement import data_files
from distlm.builder import ModelSpec
from distlm.checkpoint import TOKENIZER_DIR
from distlm.config import TrainConfig
from distlm.data.hf_tokenizer import save_tokenizer
from distlm.errors import UsageError
from distlm.parallel.names import tied_aliases, unwrap
from distlm.backends.hardware import instance_type, local_device_name

logger = logging.getLogger("distlm")


def describe_run(config: TrainConfig, data: Any, model: nn.Module, spec: ModelSpec | None,
                 tracker_ids: dict[str, str] | None = None) -> dict[str, Any]:
    dictionary = getattr(data, "dictionary", None)
    model_config = getattr(unwrap(model), "config", None)
    return {
        "config": config.to_dict(),
        "dictionary": list(dictionary.symbols) if dictionary is not None else None,
        "tied_weights": tied_aliases(model),
        "family": spec.family if spec is not None else None,
        "model_config": dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else None,
        "special_tokens": _special_tokens(spec, dictionary),
        "trackers": tracker_ids or {},
        "data_files": data_files(config.data.data),
    }


def _special_tokens(spec: ModelSpec | None, dictionary: Any) -> dict[str, Any] | None:
    """The ids Hugging Face keeps in config.json: a Hugging Face model's own, else the dictionary's."""
    if spec is not None and spec.hf_tokens is not None:
        return dataclasses.asdict(spec.hf_tokens)
    if dictionary is None:
        return None
    return {"bos_token_id": dictionary.bos(), "eos_token_id": dictionary.eos(), "pad_token_id": dictionary.pad()}


def tokenizer_writer(data: Any, task: str) -> Callable[[Path], None]:
    """Writes the tokenizer the data was made with into a checkpoint directory (rank 0)."""

    def write(directory: Path) -> None:
        dictionary = getattr(data, "dictionary", None)
        if dictionary is None:
            return
        try:
            save_tokenizer(dictionary, directory / TOKENIZER_DIR, task)
        except UsageError as err:
            logger.info("checkpoint without tokenizer files: %s", err)

    return write


RUN_JSON = "run.json"
# Variables that change how collectives run (NCCL, libfabric/EFA, Neuron runtime, gloo).
COMM_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "FI_", "NEURON_", "GLOO_")


def run_json(config: dict[str, Any], launch: dict[str, Any], device: torch.device | None = None) -> dict[str, Any]:
    """The record of one run: software, ``config`` (resolved), ``launch`` (launcher, layout), hardware, env."""
    return {
        "distlm": {"version": _version("distlm"), "git_commit": _git_commit()},
        "software": _software(),
        "config": config,
        "launch": launch,
        "hardware": _hardware(device),
        "communication_env": {key: value for key, value in sorted(os.environ.items())
                              if key.startswith(COMM_ENV_PREFIXES)},
    }


def write_run_json(directory: Path, record: dict[str, Any]) -> Path:
    """``directory/run.json``, replaced whole (written aside, then renamed); OSError if it cannot
    be, with nothing left aside."""
    directory.mkdir(parents=True, exist_ok=True)
    path, partial = directory / RUN_JSON, directory / (RUN_JSON + ".partial")
    try:
        partial.write_text(json.dumps(record, indent=1, default=str) + "\n")
        partial.replace(path)
    except OSError:
        if partial.is_file():
            partial.unlink()
        raise
    return path


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The commit of the checkout distlm runs from, "+dirty" with local changes; None outside git."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if changed else "")


def _software() -> dict[str, Any]:
    software: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                                "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        software["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for package in ("torch-neuronx", "torch-xla", "mpi4py", "transformers"):
        version = _version(package)
        if version is not None:
            software[package] = version
    return software


def _hardware(device: torch.device | None) -> dict[str, Any]:
    hardware: dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(),
                                "cpu_cores": os.cpu_count(), "instance_type": instance_type()}
    if device is not None:
        hardware["device"] = str(device)
        if device.type == "cuda":
            hardware["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        elif device.type != "cpu":
            hardware["devices"] = [local_device_name(device.type)]
    return hardware
