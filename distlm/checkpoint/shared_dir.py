"""Is ``--save-dir`` one file system that every rank reads and writes?

Every rank writes its own checkpoint shards and reads everyone's on resume, so a save
directory that is local to each node breaks a run only at its first resume, or leaves a
checkpoint whose shards lie on several disks. The probe shows it up front: rank 0 draws a
random token, every rank writes a file holding it, then every other rank reads rank 0's
file and rank 0 reads theirs. The probe files (and the directory, when the probe created
it) are removed afterwards. Training runs it before its first update
(``Checkpointer.prepare``); ``python -m distlm.doctor`` runs it as its "save dir" check.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from distlm.errors import ranks_by_value, who

PROBE_PREFIX = ".distlm-doctor-"
# A shared file system may take a moment to show a file another host just closed
# (attribute caches); a file still absent after this long is not shared.
VISIBILITY_WAIT_SEC = 2.0
_POLL_SEC = 0.05
REMEDY = "every rank reads every checkpoint, so --save-dir must be one file system shared by all nodes"


def write_probe(path: Path, text: str) -> str | None:
    """Write ``text`` to ``path`` and flush it to the file system; the error, or None."""
    try:
        with open(path, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
    except OSError as err:
        return err.strerror or str(err)
    return None


def read_probes(expected: Mapping[Path, str], wait_sec: float = VISIBILITY_WAIT_SEC) -> dict[Path, str]:
    """For each file: ``"ok"``, ``"missing"``, ``"different content"`` or the error; missing files are
    polled for up to ``wait_sec``."""
    results: dict[Path, str] = {}
    deadline = time.monotonic() + wait_sec
    while True:
        for path, text in expected.items():
            if results.get(path, "missing") != "missing":
                continue
            try:
                results[path] = "ok" if path.read_text() == text else "different content"
            except FileNotFoundError:
                results[path] = "missing"
            except OSError as err:
                results[path] = err.strerror or str(err)
        if all(result != "missing" for result in results.values()) or time.monotonic() >= deadline:
            return results
        time.sleep(_POLL_SEC)


def unseen_files(directory: Path, sizes: Mapping[str, int], wait_sec: float = VISIBILITY_WAIT_SEC) -> list[str]:
    """The files of ``sizes`` (name -> bytes written) that ``directory`` lacks, or holds with
    another size, after polling for up to ``wait_sec``; [] when all are there."""
    deadline = time.monotonic() + wait_sec
    while True:
        unseen = []
        for name, size in sizes.items():
            try:
                if os.stat(directory / name).st_size == size:
                    continue
            except OSError:
                pass
            unseen.append(name)
        if not unseen or time.monotonic() >= deadline:
            return unseen
        time.sleep(_POLL_SEC)


def file_system_type(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the file system holding ``path`` (``nfs4``, ``lustre``, ``ext4``...), from the mount table."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fields[2]
    return best_type


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def sharing_problem(reports: Sequence[dict[str, Any]]) -> str | None:
    """One line naming every rank that does not share rank 0's directory, or None.

    Each report has the rank's ``host``, ``path``, ``fs``, ``write`` (its error or None)
    and ``read``: rank 0's file as this rank saw it (None on rank 0, or when rank 0 wrote
    nothing); rank 0's also has ``view``, each other rank's file as rank 0 saw it.
    """
    hosts = [report["host"] for report in reports]
    path = reports[0]["path"]
    problems = []
    unwritable = [rank for rank, report in enumerate(reports) if report["write"] is not None]
    for rank in unwritable:
        problems.append(f"{who([rank], hosts)} cannot write to it ({reports[rank]['write']})")
    for outcome, ranks in ranks_by_value([report["read"] for report in reports]).items():
        if outcome not in ("ok", None):
            problems.append(f"{who(ranks, hosts)} cannot read the file rank 0 wrote ({outcome})")
    blind = [int(rank) for rank, outcome in reports[0]["view"].items() if outcome != "ok"]
    if blind:
        problems.append(f"rank 0 cannot read the files written by {who(blind, hosts)}")
    if not problems:
        return None
    other_paths = {report["path"] for report in reports} - {path}
    given = f" (other ranks were given {', '.join(sorted(other_paths))})" if other_paths else ""
    return f"{path}{given}: " + "; ".join(problems) + f": {REMEDY}"


def _probe_name(token: str, rank: int) -> str:
    return f"{PROBE_PREFIX}{token}" if rank == 0 else f"{PROBE_PREFIX}{token}.rank{rank}"


def probe_save_dir(rank: int, world_size: int, save_dir: str,
                   gather: Callable[[Any], list[Any]]) -> list[dict[str, Any]] | str:
    """Every rank's report on ``save_dir`` (for ``sharing_problem``), the same on every rank,
    or why rank 0 cannot create the directory (collective: ``gather(obj)`` returns every
    rank's ``obj`` in rank order); removes what it wrote."""
    directory = Path(os.path.abspath(save_dir))
    created: Path | None = None
    ancestor = directory
    own_file: Path | None = None
    try:
        announcement = None
        if rank == 0:
            ancestor = nearest_existing(directory)
            announcement = {"token": secrets.token_hex(16), "error": None}
            try:
                directory.mkdir(parents=True, exist_ok=True)
                if ancestor != directory:
                    created = directory  # removed afterwards, up to what existed
            except OSError as err:
                announcement["error"] = err.strerror or str(err)
        announcement = gather(announcement)[0]
        if announcement["error"] is not None:
            return f"{directory}: rank 0 cannot create it ({announcement['error']})"
        token = announcement["token"]

        own_file = directory / _probe_name(token, rank)
        write_error = write_probe(own_file, f"{token} {rank}")
        if write_error is not None:
            own_file = None
        # Every probe file is written (or failed) once this exchange completes.
        written = [error is None for error in gather(write_error)]

        report: dict[str, Any] = {
            "host": socket.gethostname(),
            "path": str(directory),
            "fs": file_system_type(nearest_existing(directory)),
            "write": write_error,
            "read": None,
        }
        if rank == 0:
            others = {directory / _probe_name(token, r): f"{token} {r}" for r in range(1, world_size) if written[r]}
            outcomes = read_probes(others)
            report["view"] = {str(r): outcomes[directory / _probe_name(token, r)]
                              for r in range(1, world_size) if written[r]}
        elif written[0]:
            rank0_file = directory / _probe_name(token, 0)
            report["read"] = read_probes({rank0_file: f"{token} 0"})[rank0_file]
        return gather(report)
    finally:
        if own_file is not None:
            own_file.unlink(missing_ok=True)
        if created is not None:
            _remove_created(created, ancestor)


def _remove_created(created: Path, ancestor: Path) -> None:
    """Remove the directories rank 0 created, up to ``ancestor``, once they are empty again.

    The other ranks remove their probe files after the last exchange, so rank 0 may
    find one still there for a moment; a directory that stays non-empty (someone else
    wrote into it meanwhile) is left alone.
    """
    deadline = time.monotonic() + VISIBILITY_WAIT_SEC
    path = created
    while path != ancestor and path != path.parent:
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(_POLL_SEC)
            continue
        path = path.parent
