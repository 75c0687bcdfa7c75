"""Check: ``--save-dir`` is one file system that every rank reads and writes.

The probe is training's own (distlm/checkpoint/shared_dir.py), which every training job
runs before its first update; the doctor runs it over its timed channel, which names a
rank that never arrives, and reports the file system it found.
"""

from __future__ import annotations

from typing import Any, Sequence

from distlm.checkpoint import shared_dir
from distlm.doctor.channel import RankChannel
from distlm.doctor.report import FAIL, PASS, SKIP, Row, count

NAME = "save dir"


def judge_save_dir(reports: Sequence[dict[str, Any]]) -> Row:
    """FAIL naming every rank that does not share rank 0's directory; PASS with its file system
    (``shared_dir.sharing_problem`` says what each report holds)."""
    path = reports[0]["path"]
    data = {"path": path, "ranks": list(reports)}
    problem = shared_dir.sharing_problem(reports)
    if problem is not None:
        return Row(NAME, FAIL, problem, data)
    nodes = len({report["host"] for report in reports})
    fs = reports[0]["fs"]
    scope = (
        f"{len(reports)} ranks on {nodes} hosts read rank 0's file and rank 0 read theirs"
        if nodes > 1
        else f"{count(len(reports), 'rank')} on one host (sharing across nodes not tested)"
    )
    return Row(NAME, PASS, f"{path}{f' ({fs})' if fs else ''}: {scope}", data)


def check_save_dir(channel: RankChannel, save_dir: str, no_save: bool) -> list[Row]:
    """Probe ``save_dir`` from every rank (collective); removes what it wrote."""
    if no_save:
        return [Row(NAME, SKIP, "--no-save: the job saves and resumes nothing")]
    reports = shared_dir.probe_save_dir(channel.rank, channel.world_size, save_dir,
                                        lambda obj: channel.gather(obj, NAME))
    if isinstance(reports, str):
        return [Row(NAME, FAIL, reports)]
    return [judge_save_dir(reports)]
