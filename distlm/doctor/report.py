"""The doctor's result: one row per check, printed as a plain-text table or as JSON."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Sequence

PASS, FAIL, WARN, SKIP = "PASS", "FAIL", "WARN", "SKIP"
STATUSES = (PASS, FAIL, WARN, SKIP)


@dataclass
class Row:
    """One check: its name, PASS/FAIL/WARN/SKIP, a one-line detail, and figures for ``--json``."""

    name: str
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")


def exit_status(rows: Sequence[Row]) -> int:
    """0 when no check failed (warnings and skips included), 1 otherwise."""
    return 1 if any(row.status == FAIL for row in rows) else 0


def count(number: int, noun: str) -> str:
    """``count(1, "rank")`` -> ``"1 rank"``, ``count(2, "host")`` -> ``"2 hosts"``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    start = previous = None
    for rank in ordered + [None]:
        if start is not None and (rank is None or rank != previous + 1):
            spans.append(str(start) if start == previous else f"{start}-{previous}")
            start = None
        if rank is not None and start is None:
            start = rank
        previous = rank
    return ", ".join(spans)


def who(ranks: Iterable[int], hosts: Sequence[str], most: int = 3) -> str:
    """``"rank 1 (host b)"`` or ``"ranks 8-15 (hosts b, c)"``: ranks and the hosts they run on."""
    ordered = sorted(set(ranks))
    names = list(dict.fromkeys(hosts[rank] for rank in ordered))
    shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
    noun = "rank" if len(ordered) == 1 else "ranks"
    return f"{noun} {format_ranks(ordered)} (host{'s' if len(names) > 1 else ''} {shown})"


def ranks_by_value(values: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """The ranks holding each value, values in the order of their first rank."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for rank, value in enumerate(values):
        groups[value].append(rank)
    return dict(groups)


def render_table(rows: Sequence[Row], header: str) -> str:
    """The table rank 0 prints: a header line, one line per check, a count of statuses."""
    name_width = max([len("CHECK")] + [len(row.name) for row in rows])
    lines = [header, f"{'CHECK':<{name_width}}  STATUS  DETAIL"]
    lines += [f"{row.name:<{name_width}}  {row.status:<6}  {row.detail}" for row in rows]
    counts = {status: sum(row.status == status for row in rows) for status in STATUSES}
    verdict = "FAILED" if counts[FAIL] else "OK"
    lines.append(
        f"doctor: {verdict}: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[WARN]} warned, "
        f"{counts[SKIP]} skipped"
    )
    return "\n".join(lines)


def render_json(rows: Sequence[Row], launch: Mapping[str, Any]) -> str:
    """One JSON object: ``ok``, the launch rank 0 saw, and every check with its figures."""
    return json.dumps(
        {
            "ok": exit_status(rows) == 0,
            "launch": dict(launch),
            "checks": [
                {"name": row.name, "status": row.status, "detail": row.detail, "data": row.data} for row in rows
            ],
        },
        indent=2,
    )
