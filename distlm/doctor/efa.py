"""Checks on EFA hosts: libfabric's EFA provider, NCCL's network plugin, distlm's EFA variables.

A broken link in this chain does not stop NCCL: without the aws-ofi-nccl plugin, or with
libfabric unable to open the EFA device, NCCL falls back to TCP sockets and training
runs at a fraction of the bandwidth with no error. These rows name the hosts where that
would happen. Hosts without EFA skip them; the EFA device is found with the backends'
own ``efa_available``, so the doctor and training agree on what an EFA host is.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from distlm.backends.efa import EFA_RDMA_PRESET, build_efa_preset, efa_available
from distlm.doctor.channel import RankChannel
from distlm.doctor.report import FAIL, PASS, SKIP, WARN, Row, count, ranks_by_value, who

LIBFABRIC = "efa libfabric"
PLUGIN = "nccl net plugin"
VARIABLES = "efa variables"
NAMES = (LIBFABRIC, PLUGIN, VARIABLES)

# Where the EFA installer, the AWS Deep Learning AMIs and AWS's containers put aws-ofi-nccl.
# NCCL loads the plugin with dlopen, so a copy here counts only if LD_LIBRARY_PATH or
# the loader cache leads to it; these are searched to say where it is when it does not.
NCCL_NET_PLUGIN_DIRS = (
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/ofi-nccl/lib64",
    "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu",
    "/opt/amazon/ofi-nccl/lib/aarch64-linux-gnu",
    "/opt/aws-ofi-nccl/lib",
)
# Names aws-ofi-nccl has shipped under: libnccl-net.so (what NCCL loads by default; a
# symlink since aws-ofi-nccl 1.14), libnccl-net-ofi.so (1.14 on), libnccl-net-aws.so
# (NGC containers' rename).
_OTHER_PLUGIN_NAMES = ("libnccl-net-ofi.so", "libnccl-net-aws.so")
_SUBPROCESS_TIMEOUT_SEC = 10.0


# --------------------------------------------------------------------------- libfabric


def _run(command: list[str]) -> subprocess.CompletedProcess | str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=_SUBPROCESS_TIMEOUT_SEC)
    except subprocess.TimeoutExpired:
        return f"{' '.join(command)} did not finish in {_SUBPROCESS_TIMEOUT_SEC:g} s"
    except OSError as err:
        return f"{' '.join(command)}: {err.strerror or err}"


def run_fi_info(fi_info: str | None = None) -> dict[str, Any]:
    """What ``fi_info -p efa`` reports: ``ok``, the EFA domains, libfabric's version, or the error."""
    path = fi_info or shutil.which("fi_info")
    report: dict[str, Any] = {"fi_info": path, "ok": False, "domains": [], "version": None, "error": None}
    if path is None:
        report["error"] = "fi_info not found on PATH"
        return report
    result = _run([path, "-p", "efa"])
    if isinstance(result, str):
        report["error"] = result
        return report
    lines = [line.strip() for line in result.stdout.splitlines()]
    report["domains"] = sorted({line.split(":", 1)[1].strip() for line in lines if line.startswith("domain:")})
    report["ok"] = result.returncode == 0 and "provider: efa" in lines
    if not report["ok"]:
        output = (result.stderr.strip() or result.stdout.strip()).splitlines()
        report["error"] = output[0] if output else f"exit status {result.returncode}"
    version = _run([path, "--version"])
    if not isinstance(version, str):
        for line in version.stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "libfabric":
                report["version"] = value.strip()
    return report


# --------------------------------------------------------------------------- NCCL plugin


def loader_cache_libraries(ldconfig: str | None = None) -> dict[str, str]:
    """Library name -> path, from the dynamic loader's cache (``ldconfig -p``); empty if unavailable."""
    path = ldconfig or shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if path is None:
        return {}
    result = _run([path, "-p"])
    if isinstance(result, str) or result.returncode != 0:
        return {}
    libraries: dict[str, str] = {}
    for line in result.stdout.splitlines():
        name, arrow, target = line.strip().partition(" => ")
        if arrow:
            libraries.setdefault(name.split(" (")[0], target.strip())
    return libraries


def find_nccl_net_plugin(
    environ: Mapping[str, str],
    install_dirs: Sequence[str] = NCCL_NET_PLUGIN_DIRS,
    loader_cache: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Where NCCL would find its network plugin: ``path``, ``loadable``, ``via``, and a ``hint``.

    NCCL dlopens ``$NCCL_NET_PLUGIN`` (a path or a library name), then
    ``libnccl-net-$NCCL_NET_PLUGIN.so``; with the variable unset, ``libnccl-net.so``.
    dlopen finds a bare name through LD_LIBRARY_PATH and the loader cache only.
    """
    choice = environ.get("NCCL_NET_PLUGIN") or None
    if choice == "none":
        return {"path": None, "loadable": False, "via": "NCCL_NET_PLUGIN", "names": [],
                "hint": "NCCL_NET_PLUGIN=none turns network plugins off; unset it"}
    if choice is not None and "/" in choice:
        found = Path(choice).is_file()
        return {
            "path": choice if found else None, "loadable": found, "via": "NCCL_NET_PLUGIN",
            "names": [choice], "hint": None if found else f"NCCL_NET_PLUGIN={choice} does not exist",
        }
    names = [choice, f"libnccl-net-{choice}.so"] if choice is not None else ["libnccl-net.so"]
    library_path = [entry for entry in environ.get("LD_LIBRARY_PATH", "").split(":") if entry]
    for directory in library_path:
        for name in names:
            if (Path(directory) / name).is_file():
                return {"path": str(Path(directory) / name), "loadable": True, "via": "LD_LIBRARY_PATH",
                        "names": names, "hint": None}
    cache = loader_cache_libraries() if loader_cache is None else loader_cache
    for name in names:
        if name in cache:
            return {"path": cache[name], "loadable": True, "via": "the loader cache", "names": names, "hint": None}
    report: dict[str, Any] = {"path": None, "loadable": False, "via": None, "names": names, "hint": None}
    for directory in install_dirs:
        for name in names:
            if (Path(directory) / name).is_file():
                report["path"] = str(Path(directory) / name)
                report["hint"] = f"add {directory} to LD_LIBRARY_PATH"
                return report
    if choice is None:
        for directory in [*library_path, *install_dirs]:
            for name in _OTHER_PLUGIN_NAMES:
                if (Path(directory) / name).is_file():
                    suffix = name[len("libnccl-net-"):-len(".so")]
                    report["hint"] = f"found {Path(directory) / name}: export NCCL_NET_PLUGIN={suffix}"
                    return report
    report["hint"] = "install aws-ofi-nccl (AWS's EFA installer does), or use an AWS Deep Learning AMI or container"
    return report


# --------------------------------------------------------------------------- variables


def efa_variables(
    preset: Mapping[str, str], before: Mapping[str, str], now: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """Each preset variable by who set it: ``distlm`` (the preset, at start-up), ``user_same``,
    ``user_different`` (name -> [yours, preset]) or ``unset``."""
    sorted_out: dict[str, dict[str, Any]] = {"distlm": {}, "user_same": {}, "user_different": {}, "unset": {}}
    for name, value in preset.items():
        if name in before:
            key = "user_same" if before[name] == value else "user_different"
            sorted_out[key][name] = before[name] if key == "user_same" else [before[name], value]
        elif name in now:
            sorted_out["distlm"][name] = now[name]
        else:
            sorted_out["unset"][name] = value
    return sorted_out


def _describe_variables(variables: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    if variables["distlm"]:
        parts.append("distlm sets " + " ".join(f"{k}={v}" for k, v in variables["distlm"].items()))
    if variables["user_same"]:
        parts.append("yours, as the preset: " + " ".join(f"{k}={v}" for k, v in variables["user_same"].items()))
    if variables["user_different"]:
        parts.append(
            "yours override the preset: "
            + " ".join(f"{k}={mine} (preset {theirs})" for k, (mine, theirs) in variables["user_different"].items())
        )
    if variables["unset"]:
        unset = " ".join(f"{k}={v}" for k, v in variables["unset"].items())
        parts.append(f"not set (the preset would set {unset})")
    return "; ".join(parts)


# --------------------------------------------------------------------------- the check


def probe_efa(
    dist_backend: str,
    gpudirect_rdma: bool | None,
    before: Mapping[str, str],
    now: Mapping[str, str],
    sysfs_root: str | os.PathLike = "/sys",
    fi_info: str | None = None,
) -> dict[str, Any]:
    """This rank's view: is it on an EFA host, and if so libfabric, NCCL's plugin and the preset variables.

    ``gpudirect_rdma`` is the backend's answer for this rank's device; None where the
    backend does not say, and then the preset is taken to include RDMA if the variable is set.
    """
    report: dict[str, Any] = {"host": socket.gethostname(), "efa": efa_available(sysfs_root, use_fi_info=True)}
    if not report["efa"]:
        return report
    report["fabric"] = run_fi_info(fi_info)
    if dist_backend == "nccl":
        report["plugin"] = find_nccl_net_plugin(now)
    if dist_backend != "gloo":
        rdma = gpudirect_rdma if gpudirect_rdma is not None else all(name in now for name in EFA_RDMA_PRESET)
        report["variables"] = efa_variables(build_efa_preset(rdma), before, now)
    return report


def judge_efa(reports: Sequence[dict[str, Any]], dist_backend: str, network: str) -> list[Row]:
    """The three EFA rows from every rank's probe."""
    hosts = [report["host"] for report in reports]
    with_efa = [rank for rank, report in enumerate(reports) if report["efa"]]
    if not with_efa:
        why = (
            "no EFA device on any host (nothing named rdmap*/efa* in /sys/class/infiniband, "
            "and fi_info -p efa finds none)"
        )
        return [Row(LIBFABRIC, SKIP, why), Row(PLUGIN, SKIP, "no EFA device"), Row(VARIABLES, SKIP, "no EFA device")]
    without = [rank for rank in range(len(reports)) if rank not in with_efa]
    rows = [_judge_fabric(reports, with_efa, without, hosts)]
    if dist_backend == "gloo":
        why = "gloo (--device cpu) talks TCP; neither NCCL nor the EFA preset is used"
        return rows + [Row(PLUGIN, SKIP, why), Row(VARIABLES, SKIP, why)]
    if dist_backend == "nccl":
        rows.append(_judge_plugin(reports, with_efa, hosts))
    else:
        rows.append(Row(PLUGIN, SKIP, f"the {dist_backend} process group drives libfabric itself, without NCCL"))
    rows.append(_judge_variables(reports, with_efa, hosts, network))
    return rows


def _judge_fabric(reports, with_efa: list[int], without: list[int], hosts: list[str]) -> Row:
    data = {"ranks": [report.get("fabric") for report in reports]}
    problems = []
    if without:
        problems.append(f"no EFA device on {who(without, hosts)}, while {who(with_efa, hosts)} have one")
    for error, ranks in ranks_by_value([reports[rank]["fabric"]["error"] for rank in with_efa]).items():
        if error is not None:
            ranks = [with_efa[i] for i in ranks]
            problems.append(f"fi_info -p efa fails on {who(ranks, hosts)}: {error}")
    if problems:
        return Row(LIBFABRIC, FAIL, "; ".join(problems) + " (collectives there would not use EFA)", data)
    fabric = reports[with_efa[0]]["fabric"]
    domains = fabric["domains"]
    listed = ", ".join(domains[:4]) + (f" and {len(domains) - 4} more" if len(domains) > 4 else "")
    return Row(
        LIBFABRIC,
        PASS,
        f"fi_info -p efa on {count(len(set(hosts)), 'host')}: libfabric {fabric['version'] or '(version unknown)'}, "
        f"EFA domains {listed or '(none listed)'}",
        data,
    )


def _judge_plugin(reports, with_efa: list[int], hosts: list[str]) -> Row:
    data = {"ranks": [report.get("plugin") for report in reports]}
    missing = [rank for rank in with_efa if not reports[rank]["plugin"]["loadable"]]
    if missing:
        plugin = reports[missing[0]]["plugin"]
        if plugin["path"]:
            where = f"{plugin['path']} is not on LD_LIBRARY_PATH or in the loader cache"
        elif plugin["names"]:
            where = (
                f"no {' or '.join(plugin['names'])} on LD_LIBRARY_PATH, in the loader cache or in "
                f"{', '.join(NCCL_NET_PLUGIN_DIRS)}"
            )
        else:
            where = "no plugin is loaded"
        return Row(
            PLUGIN,
            FAIL,
            f"{who(missing, hosts)}: {where}, so NCCL would use TCP sockets instead of EFA; {plugin['hint']}",
            data,
        )
    paths = ranks_by_value([(reports[rank]["plugin"]["path"], reports[rank]["plugin"]["via"]) for rank in with_efa])
    return Row(PLUGIN, PASS, "; ".join(f"{path} (through {via})" for path, via in paths), data)


def _judge_variables(reports, with_efa: list[int], hosts: list[str], network: str) -> Row:
    data = {"ranks": [report.get("variables") for report in reports]}
    texts = ranks_by_value([_describe_variables(reports[rank]["variables"]) for rank in with_efa])
    if len(texts) == 1:
        detail = next(iter(texts))
    else:
        detail = "; ".join(f"{who([with_efa[i] for i in ranks], hosts)}: {text}" for text, ranks in texts.items())
    if network == "tcp":
        return Row(VARIABLES, WARN, f"--network tcp: distlm applies no EFA preset on this EFA host; {detail}", data)
    variables = [reports[rank]["variables"] for rank in with_efa]
    if len(texts) > 1 or any(v["user_different"] or v["unset"] for v in variables):
        return Row(VARIABLES, WARN, detail, data)
    return Row(VARIABLES, PASS, detail, data)


def check_efa(
    channel: RankChannel, dist_backend: str, gpudirect_rdma: bool | None, network: str, before: Mapping[str, str]
) -> list[Row]:
    """Gather every rank's EFA probe and judge it (collective)."""
    reports = channel.gather(probe_efa(dist_backend, gpudirect_rdma, before, os.environ), LIBFABRIC)
    return judge_efa(reports, dist_backend, network)
