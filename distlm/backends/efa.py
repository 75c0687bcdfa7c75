"""The AWS EFA network preset: libfabric settings for NCCL (p4d/p5) and the Neuron runtime (trn).

Whether an EFA device exists and which environment variables the preset sets are pure
functions of their inputs, so they are tested on a machine without EFA. The preset never
overrides a variable the user has set, and says on rank 0 what it set and what it kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import MutableMapping

from distlm.backends.base import check_network_name
from distlm.errors import UsageError

logger = logging.getLogger(__name__)

# Settings for collectives over EFA (NCCL through the aws-ofi-nccl plugin; the Neuron
# runtime through libfabric), following AWS's published EFA guidance and the
# aws-ofi-nccl maintainers. Only settings that are right on every EFA stack:
EFA_PRESET: dict[str, str] = {
    # Pin libfabric to the EFA provider. Otherwise a broken EFA install silently falls
    # back to the TCP provider and training runs at a fraction of the bandwidth with no
    # error; pinned, it fails when the communicator starts. Needed by aws-ofi-nccl <= 1.5,
    # harmless after.
    "FI_PROVIDER": "efa",
    # DataLoader workers fork after the collectives registered memory with EFA; on
    # kernels before 5.15 (no copy-on-fork for pinned pages) that corrupts registered
    # buffers. Libfabric ignores it where the kernel makes it unnecessary.
    "FI_EFA_FORK_SAFE": "1",
    # Libfabric's huge-page bounce buffers can leave fork() in DataLoader workers failing
    # with "OSError: Cannot allocate memory"; AWS recommends 0 on every software version,
    # at a minor speed cost.
    "FI_EFA_USE_HUGE_PAGE": "0",
}
# Deliberately absent: NCCL_PROTO=simple (aws-ofi-nccl >= 1.7 chooses the protocol per
# platform; forcing Simple loses LL128 on p5), NCCL_SOCKET_IFNAME (interface names differ
# between AMIs and a wrong guess breaks NCCL's bootstrap), NCCL_ALGO / NCCL_MIN_NCHANNELS
# / NCCL_BUFFSIZE (AWS: keep NCCL's defaults), RDMAV_FORK_SAFE (AWS: can break newer kernels).

# RDMA over EFA (device memory straight onto the wire) exists on p4d/p4de/p5 and on the
# Trainium instances, whose Neuron multi-node setups set this variable. Libfabric >= 1.18
# with aws-ofi-nccl >= 1.7 turns it on by itself; older stacks need it. Setting it where
# the EFA device cannot do RDMA read makes libfabric refuse to start, so each backend
# says whether its device has it.
EFA_RDMA_PRESET: dict[str, str] = {"FI_EFA_USE_DEVICE_RDMA": "1"}

_EFA_DEVICE_PREFIXES = ("rdmap", "efa")


def build_efa_preset(gpudirect_rdma: bool) -> dict[str, str]:
    preset = dict(EFA_PRESET)
    if gpudirect_rdma:
        preset.update(EFA_RDMA_PRESET)
    return preset


def find_efa_devices(sysfs_root: str | os.PathLike = "/sys") -> list[str]:
    """Names of EFA devices under ``<sysfs_root>/class/infiniband`` (``rdmap16s27``, ``efa_0``...)."""
    directory = Path(sysfs_root) / "class" / "infiniband"
    try:
        names = sorted(entry.name for entry in directory.iterdir())
    except OSError:
        return []
    return [name for name in names if name.startswith(_EFA_DEVICE_PREFIXES)]


def _fi_info_reports_efa() -> bool:
    # Containers sometimes hide /sys/class/infiniband but still have the EFA device
    # mounted and libfabric installed; ask libfabric itself then.
    fi_info = shutil.which("fi_info")
    if fi_info is None:
        return False
    try:
        result = subprocess.run([fi_info, "-p", "efa"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0 and "provider: efa" in result.stdout


def efa_available(sysfs_root: str | os.PathLike = "/sys", use_fi_info: bool = True) -> bool:
    return bool(find_efa_devices(sysfs_root)) or (use_fi_info and _fi_info_reports_efa())


def apply_env_preset(
    preset: dict[str, str], environ: MutableMapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Set each preset variable the user has not set. Returns (applied, kept user values)."""
    applied, kept = {}, {}
    for name, value in preset.items():
        if name in environ:
            kept[name] = environ[name]
        else:
            environ[name] = value
            applied[name] = value
    return applied, kept


def configure_network(
    network: str,
    environ: MutableMapping[str, str],
    gpudirect_rdma: bool,
    sysfs_root: str | os.PathLike = "/sys",
    use_fi_info: bool = True,
    log: bool = True,
) -> dict[str, str]:
    """Apply the EFA preset for ``--network`` to ``environ``; returns what was set.

    ``efa`` requires an EFA device (no silent fallback to TCP); ``auto`` applies the
    preset when one exists and does nothing otherwise; ``tcp`` never touches it.
    """
    check_network_name(network)
    if network == "tcp":
        return {}
    found = efa_available(sysfs_root, use_fi_info)
    if not found:
        if network == "efa":
            raise UsageError(
                f"--network efa but no EFA device was found (nothing named rdmap*/efa* in "
                f"{Path(sysfs_root) / 'class' / 'infiniband'}, and `fi_info -p efa` found none); "
                "attach an EFA interface to the instance or use --network tcp"
            )
        return {}
    applied, kept = apply_env_preset(build_efa_preset(gpudirect_rdma), environ)
    if log:
        logger.info(
            "network efa: set %s; kept user values %s",
            " ".join(f"{k}={v}" for k, v in applied.items()) or "nothing",
            " ".join(f"{k}={v}" for k, v in kept.items()) or "none",
        )
    return applied
