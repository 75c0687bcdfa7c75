"""Which of the devices a process sees its local rank uses, refused where ranks would share one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from distlm.errors import UsageError


def device_index(
    local_rank: int,
    local_world_size: int,
    visible_devices: int,
    visible_variable: str = "CUDA_VISIBLE_DEVICES",
    environ: Mapping[str, str] | None = None,
    parent_environ: Mapping[str, str] | None = None,
) -> int:
    """The index, among the devices this process sees, of the device local rank ``local_rank`` uses.

    ``local_rank % visible_devices``. With several visible, the node's ranks share them, so
    more local ranks than visible devices would put two ranks on one device: a
    ``UsageError`` naming ``visible_variable`` (on every rank of the node alike, so no rank
    starts and waits for the others).

    One visible device is this rank's own whatever its local rank where each rank was given
    its own: ``srun --gpus-per-task=1``, or a per-rank ``visible_variable`` set by a
    wrapper, show each one GPU as index 0. torchrun gives its workers no device of their
    own: a worker that sees one device with ``visible_variable`` as torchrun's agent had it
    (inherited, not set for this worker) shares it with every other worker of the node,
    which is refused. ``environ`` (default ``os.environ``) is this process's environment,
    ``parent_environ`` its parent's (default: read from /proc; unknown elsewhere, and then
    nothing is refused).
    """
    environ = os.environ if environ is None else environ
    setting = f"{visible_variable}={environ.get(visible_variable, 'unset')}"
    if visible_devices < 1:
        raise UsageError(f"no device is visible to local rank {local_rank} ({setting}); check the job's allocation")
    if visible_devices == 1 and local_world_size > 1 and "TORCHELASTIC_RUN_ID" in environ:
        parent = _parent_environment() if parent_environ is None else parent_environ
        if parent is not None and parent.get(visible_variable) == environ.get(visible_variable):
            raise UsageError(
                f"{local_world_size} torchrun workers on this node would share one device: each inherits "
                f"torchrun's {setting}, which shows one; make {local_world_size} devices visible to torchrun, "
                "or start one worker per node (--nproc-per-node 1)"
            )
    if visible_devices > 1 and local_world_size > visible_devices:
        raise UsageError(
            f"{local_world_size} ranks on this node but {visible_devices} devices visible ({setting}); "
            f"start at most {visible_devices} processes per node, or give each rank its own device "
            "(srun --gpus-per-task=1)"
        )
    return local_rank % visible_devices


def _parent_environment() -> dict[str, str] | None:
    """The environment this process's parent was started with (Linux's /proc); None where unknown."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {name.decode(errors="replace"): value.decode(errors="replace") for name, value in pairs}
