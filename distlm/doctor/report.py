"""The doctor's result: one row per check, printed as a plain-text table or as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from distlm.errors import count, format_ranks, ranks_by_value, who

# The checks name ranks and hosts with distlm.errors's helpers, which training's messages share.
__all__ = ["FAIL", "PASS", "SKIP", "WARN", "Row", "count", "exit_status", "format_ranks", "ranks_by_value",
           "render_json", "render_table", "who"]

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
