"""Check: the device each rank uses, what its host shows, and that ranks do not share a GPU.

CUDA is asked through ``torch.cuda`` and other accelerators through ``torch.accelerator``
(both part of every torch build; they report nothing on a CPU build). Neuron devices are
counted from their ``/dev/neuron<N>`` nodes and torch-neuronx is looked up without being
imported, since importing it starts its runtime.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Sequence

import torch

from distlm.backends.base import module_importable
from distlm.backends.hardware import host_cores
from distlm.doctor.channel import RankChannel
from distlm.doctor.report import FAIL, PASS, WARN, Row, count, ranks_by_value, who

NAME = "devices"
_NEURON_DEVICE = re.compile(r"neuron\d+")


def count_neuron_devices(dev_root: str | os.PathLike = "/dev") -> int:
    """Neuron devices of this host, one ``/dev/neuron<N>`` node each."""
    try:
        return sum(1 for entry in Path(dev_root).iterdir() if _NEURON_DEVICE.fullmatch(entry.name))
    except OSError:
        return 0


def probe_devices(backend_name: str, device: torch.device, dev_root: str | os.PathLike = "/dev") -> dict[str, Any]:
    """The device this rank uses and the hardware its host shows it."""
    report: dict[str, Any] = {
        "host": socket.gethostname(),
        "backend": backend_name,
        "device": str(device),
        "cpus": host_cores(),
        "cuda_devices": [],
        "gpu": None,
        "accelerators": 0,
        "neuron_devices": count_neuron_devices(dev_root),
        "torch_neuronx": module_importable("torch_neuronx"),
    }
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type == device.type:
        report["accelerators"] = torch.accelerator.device_count()
    if torch.cuda.is_available():
        report["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            properties = torch.cuda.get_device_properties(index)
            uuid = getattr(properties, "uuid", None)
            report["gpu"] = {
                "index": index,
                "name": properties.name,
                # The UUID tells GPUs apart even when each rank's CUDA_VISIBLE_DEVICES renumbers them.
                "uuid": str(uuid) if uuid is not None else f"index {index}",
                "capability": list(torch.cuda.get_device_capability(index)),
            }
    return report


def judge_devices(reports: Sequence[dict[str, Any]]) -> Row:
    """FAIL when ranks run on different kinds of device or share one GPU; PASS with a summary."""
    hosts = [report["host"] for report in reports]
    data = {"ranks": list(reports)}
    backends = ranks_by_value([report["backend"] for report in reports])
    if len(backends) > 1:
        return Row(
            NAME,
            FAIL,
            "ranks run on different hardware: "
            + "; ".join(f"{who(ranks, hosts)} on {name}" for name, ranks in backends.items())
            + " (give every rank the same --device, or check the nodes' drivers)",
            data,
        )
    backend = reports[0]["backend"]
    if backend == "cuda":
        return _judge_gpus(reports, hosts, data)
    if backend in ("neuron", "xla"):
        missing = [rank for rank, report in enumerate(reports) if report["neuron_devices"] == 0]
        if backend == "neuron" and missing:
            return Row(NAME, FAIL, f"{who(missing, hosts)} see no /dev/neuron* device", data)
        counts = sorted({report["neuron_devices"] for report in reports})
        cores = sorted({report["accelerators"] for report in reports})
        return Row(
            NAME,
            PASS,
            f"{backend} on every rank ({reports[0]['device']} on rank 0): {count(len(reports), 'rank')} on "
            f"{count(len(set(hosts)), 'host')} with {'/'.join(map(str, counts))} Neuron devices each"
            + (f", {'/'.join(map(str, cores))} cores visible to each rank" if any(cores) else ""),
            data,
        )
    cpus = sorted({report["cpus"] for report in reports})
    return Row(
        NAME,
        PASS,
        f"{backend} on every rank: {count(len(reports), 'rank')} on {count(len(set(hosts)), 'host')}, "
        f"{'/'.join(map(str, cpus))} CPUs visible to each",
        data,
    )


def _judge_gpus(reports: Sequence[dict[str, Any]], hosts: list[str], data: dict[str, Any]) -> Row:
    gpus = [report["gpu"] for report in reports]
    # Two ranks of one host on one GPU: CUDA_VISIBLE_DEVICES or the local ranks are wrong.
    shared = [
        ranks
        for ranks in ranks_by_value([(hosts[rank], gpu["uuid"]) for rank, gpu in enumerate(gpus)]).values()
        if len(ranks) > 1
    ]
    if shared:
        return Row(
            NAME,
            FAIL,
            "ranks share a GPU: "
            + "; ".join(f"{who(ranks, hosts)} on {gpus[ranks[0]]['uuid']}" for ranks in shared)
            + " (one GPU per rank: check CUDA_VISIBLE_DEVICES and the launcher's ranks per node)",
            data,
        )
    models = ranks_by_value([gpu["name"] for gpu in gpus])
    per_host = sorted({len(report["cuda_devices"]) for report in reports})
    summary = (
        f"cuda on every rank, one GPU each: {count(len(reports), 'rank')} on {count(len(set(hosts)), 'host')} with "
        f"{'/'.join(map(str, per_host))} GPUs each"
    )
    if len(models) > 1:
        return Row(
            NAME,
            WARN,
            summary + "; mixed GPU models: "
            + "; ".join(f"{who(ranks, hosts)}: {name}" for name, ranks in models.items()),
            data,
        )
    return Row(NAME, PASS, f"{summary}, {next(iter(models))}", data)


def check_devices(channel: RankChannel, backend_name: str, device: torch.device) -> list[Row]:
    """Gather every rank's devices and judge them (collective)."""
    return [judge_devices(channel.gather(probe_devices(backend_name, device), NAME))]
