"""``run.json``, beside the checkpoints (and the scaling suite's results), says what ran where:
distlm's version and commit, torch and backend versions, the resolved config, the launcher
and layout, the hardware and the communication environment variables.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

from distlm.backends.hardware import instance_type, local_device_name

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
