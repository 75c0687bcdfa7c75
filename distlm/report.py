"""``python -m distlm.report LOG [LOG ...] --out DIR``: pictures of training logs.

Reads distlm's JSON lines (stdout or ``--log-file``) and fairseq's ``--log-format json``
logs (``train_inner`` and ``valid`` records, values written as strings), so runs of both
share the same axes, one line per log. Writes a PNG per quantity and ``index.html``
showing them: train and validation loss against updates and against tokens seen,
tokens/s and MFU, learning rate, gradient norm and loss scale.

Tokens seen are summed from each train line as (tokens per update) x (updates since the
previous line): distlm's tokens per update is ``wps / ups``, fairseq's ``wpb``.
"""

from __future__ import annotations

import html
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from distlm.errors import OneLineErrorParser, UsageError, report_usage_error

# A log is untrusted input: a record of distlm or fairseq is one short line of flat JSON
# (fairseq's longest, its arguments, is about 11 KiB), so a longer line or deeper nesting is
# not a log of theirs. The caps keep memory bounded on a file with no newlines and keep
# json's recursive parser from running out of stack.
MAX_LINE_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))

# (file, title, y label, [(series, key)], y log scale)
PLOTS = (
    ("loss_vs_updates.png", "Loss against updates", "loss (bits)", [("train", "loss"), ("valid", "loss")], False),
    ("loss_vs_tokens.png", "Loss against tokens seen", "loss (bits)", [("train", "loss"), ("valid", "loss")], False),
    ("tokens_per_s.png", "Tokens per second (all ranks)", "tokens/s", [("train", "wps")], False),
    ("mfu.png", "Model FLOP utilisation", "MFU", [("train", "mfu")], False),
    ("lr.png", "Learning rate", "lr", [("train", "lr")], False),
    ("gnorm.png", "Gradient norm", "gnorm", [("train", "gnorm")], True),
    ("loss_scale.png", "Loss scale (fp16)", "loss scale", [("train", "loss_scale")], True),
)
# A log's lines share its colour; train and validation differ by line style.
_STYLES = {"train": {"linestyle": "-", "marker": None}, "valid": {"linestyle": "--", "marker": "o"}}


@dataclass
class RunLog:
    """One log's points: train lines and validation lines, each a dict with update and tokens."""

    label: str
    source: str
    """distlm or fairseq"""
    train: list[dict[str, float]] = field(default_factory=list)
    valid: list[dict[str, float]] = field(default_factory=list)


def read_log(path: Path) -> RunLog:
    """The train and validation points of a distlm or fairseq JSON log."""
    run = RunLog(path.name, "distlm")
    fairseq_seen = False
    for number, line in enumerate(_log_lines(path), start=1):
        if _nesting_depth(line) > MAX_JSON_DEPTH:
            raise UsageError(f"{path}: line {number} nests JSON more than {MAX_JSON_DEPTH} levels deep; distlm "
                             "and fairseq records are flat: give a distlm JSON log or fairseq's --log-format json")
        parsed = _json_of(line)
        if parsed is None:
            continue
        tag, record = parsed
        if "kind" in record:
            point = _numbers(record)
            if record["kind"] == "train" and "update" in point:
                run.train.append(point)
            elif record["kind"] == "valid" and "update" in point:
                run.valid.append({**point, "subset": record.get("subset", "valid")})
            continue
        point = _fairseq_point(tag, record)
        if point is not None:
            fairseq_seen = True
            (run.valid if "subset" in point else run.train).append(point)
    if not run.train and not run.valid:
        raise UsageError(f"{path}: no train or valid records (a distlm JSON log, or fairseq-train --log-format json)")
    if fairseq_seen:
        run.source = "fairseq"
    # A resumed run logs again the updates after its checkpoint: its points replace the earlier ones.
    run.train = sorted({p["update"]: p for p in run.train}.values(), key=lambda p: p["update"])
    run.valid = sorted({(p["subset"], p["update"]): p for p in run.valid}.values(), key=lambda p: p["update"])
    _add_tokens(run)
    return run


def _log_lines(path: Path) -> Iterator[str]:
    """The lines of the regular file at ``path``, each at most MAX_LINE_BYTES (UsageError otherwise)."""
    try:
        # Non-blocking, so that opening a named pipe returns at once; fstat then judges the
        # file opened, not one that replaced it after a check.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise UsageError(f"{path}: cannot read the log ({err.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "a special file")
        raise UsageError(f"{path} is {kind}, not a regular file; give the log file itself (distlm's --log-file "
                         "or fairseq's output)")
    os.set_blocking(fd, True)
    with open(fd, "rb") as file:
        number = 0
        try:
            while line := file.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):  # newline excluded, it fits
                    raise UsageError(f"{path}: line {number} is longer than {MAX_LINE_BYTES >> 20} MiB; distlm and "
                                     "fairseq write one short JSON record a line: is this a training log?")
                yield line.decode("utf-8", errors="replace")
        except OSError as err:
            raise UsageError(f"{path}: cannot read the log ({err.strerror})") from None


def _nesting_depth(line: str) -> int:
    """How deep the brackets of the JSON in ``line`` (from its first brace, as _json_of reads it)
    nest outside strings; counted only where enough brackets exist to exceed MAX_JSON_DEPTH,
    which a flat record never has."""
    text = line[max(line.find("{"), 0):]
    if text.count("{") + text.count("[") <= MAX_JSON_DEPTH:
        return 0
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "}]":
            depth -= 1
    return deepest


def _json_of(line: str) -> tuple[str | None, dict[str, Any]] | None:
    """(logger name, record) of a JSON line, bare or after fairseq's "time | LEVEL | name | " prefix."""
    start = line.find("{")
    if start < 0:
        return None
    try:
        record = json.loads(line[start:])
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    prefix = [part.strip() for part in line[:start].split("|")]
    tag = prefix[-2] if len(prefix) >= 3 else None
    return tag, record


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # fairseq writes numbers as strings; distlm writes "nan"/"inf" so
        except ValueError:
            return None
    return None


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {key: number for key, value in record.items() if (number := _number(value)) is not None}


def _fairseq_point(tag: str | None, record: dict[str, Any]) -> dict[str, Any] | None:
    """A fairseq record as a distlm point: train_inner keys as they are, valid_* without the prefix."""
    if tag == "valid" or any(key.startswith("valid_") for key in record):
        values = {key.removeprefix("valid_"): v for key, v in _numbers(record).items() if key.startswith("valid_")}
        if "num_updates" not in values:
            return None
        return {**values, "update": values.pop("num_updates"), "subset": "valid"}
    # train_inner records carry num_updates; the end-of-epoch "train" record has train_num_updates.
    if tag in (None, "train_inner") and "num_updates" in record:
        values = _numbers(record)
        values.pop("update", None)  # fairseq's "update" is the fraction of the epoch
        values["update"] = values.pop("num_updates")
        values["wpb"] = values.get("wpb", 0.0)
        return values
    return None


def _add_tokens(run: RunLog) -> None:
    """Cumulative tokens seen at each train point, and at each validation by its update."""
    tokens, last_update = 0.0, 0.0
    seen: list[tuple[float, float]] = []
    for point in run.train:
        per_update = point.get("wpb") or (point["wps"] / point["ups"] if point.get("ups") else 0.0)
        tokens += per_update * max(point["update"] - last_update, 0.0)
        last_update = point["update"]
        point["tokens"] = tokens
        seen.append((point["update"], tokens))
    for point in run.valid:
        before = [t for update, t in seen if update <= point["update"]]
        point["tokens"] = before[-1] if before else 0.0


def write_report(runs: list[RunLog], out: Path) -> list[Path]:
    """The PNGs (a plot only where some log has its quantity) and index.html; returns the PNGs."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title, ylabel, series, log_scale in PLOTS:
        x_key = "tokens" if "tokens" in name else "update"
        figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=80)
        drawn_runs: dict[int, RunLog] = {}
        drawn_kinds: list[str] = []
        for index, run in enumerate(runs):
            for kind, key in series:
                points = [p for p in getattr(run, kind) if key in p and p[key] == p[key]]  # nan != nan
                if not points:
                    continue
                axes.plot([p[x_key] for p in points], [p[key] for p in points], color=_color(index), markersize=3,
                          **_STYLES[kind])
                drawn_runs[index] = run
                drawn_kinds += [kind] if kind not in drawn_kinds else []
        if not drawn_runs:
            plt.close(figure)
            continue
        axes.set_title(title)
        axes.set_xlabel("tokens seen" if x_key == "tokens" else "updates")
        axes.set_ylabel(ylabel)
        if log_scale:
            axes.set_yscale("log")
        axes.grid(alpha=0.3)
        entries = legend_entries(drawn_runs, drawn_kinds)
        axes.legend([_line(plt, **style) for _, style in entries], [label for label, _ in entries], fontsize=7)
        figure.tight_layout()
        figure.savefig(out / name)
        plt.close(figure)
        written.append(out / name)
    _write_html(runs, written, out / "index.html")
    return written


def legend_entries(runs: dict[int, RunLog], kinds: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(label, line style) of each legend entry: each log once, in its colour, and where a plot
    has train and validation lines, each kind once, by its line style. A label joining log and
    kind read "train (distlm) train" for a log named train.log."""
    entries = [(f"{run.label} ({run.source})", {"color": _color(index), "linestyle": "-"})
               for index, run in runs.items()]
    if len(kinds) > 1:
        entries += [(kind, {"color": "grey", **_STYLES[kind]}) for kind in kinds]
    return entries


def _color(index: int) -> str:
    return f"C{index % 10}"


def _line(plt: Any, **style: Any) -> Any:
    return plt.Line2D([], [], markersize=3, **style)


def _write_html(runs: list[RunLog], pictures: list[Path], path: Path) -> None:
    items = "".join(f"<li>{html.escape(run.label)}: {run.source}, {len(run.train)} train and "
                    f"{len(run.valid)} validation records</li>" for run in runs)
    images = "".join(f'<figure><img src="{html.escape(p.name)}" alt="{html.escape(p.stem)}"></figure>'
                     for p in pictures)
    path.write_text(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>distlm report</title>"
        "<style>figure{display:inline-block;margin:4px}</style></head>"
        f"<body><h1>distlm report</h1><ul>{items}</ul>{images}</body></html>\n"
    )


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("distlm.report needs matplotlib: pip install 'distlm[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labels(paths: list[Path]) -> list[str]:
    """File names, or whole paths where two logs share a name."""
    names = [p.name for p in paths]
    return [name if names.count(name) == 1 else str(p) for name, p in zip(names, paths)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m distlm.report",
                                description="Plot distlm and fairseq JSON training logs (PNG + HTML).")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="distlm JSON log (--log-file) or fairseq JSON log")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the PNGs and index.html")
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file; name a directory for the pictures and index.html")
        paths = [Path(log) for log in args.logs]
        runs = [read_log(path) for path in paths]
        for run, label in zip(runs, _labels(paths)):
            run.label = label
        try:
            pictures = write_report(runs, out)
        except OSError as err:  # a parent that is a file, no permission, a full disk
            raise UsageError(f"--out {out}: cannot write {err.filename or 'there'} ({err.strerror or err})") from None
    except UsageError as exc:
        return report_usage_error("distlm.report: error: ", exc, 0)
    print(f"{len(pictures)} pictures and {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
