"""Rank 0's lines: JSON lines, fairseq's simple ``key value`` lines, or a tqdm bar on a terminal;
numbers rounded to significant digits as every line shows them."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Iterator

from tqdm import tqdm


def significant(value: float | None, digits: int = 6) -> float | None:
    """``value`` rounded to ``digits`` significant digits, as the log lines show numbers: a
    learning rate of 1e-9 or an MFU of 3e-6 keeps its digits where rounding to decimals
    printed 0.0; None, inf and nan stay as they are."""
    if value is None or not math.isfinite(value):
        return value
    return float(f"{value:.{digits}g}")


def strict_json(value):
    """``value`` with non-finite floats written as the strings "inf", "-inf" and "nan"
    (strict JSON has no such numbers; Python's json would print Infinity/NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


class Printer:
    """Rank 0's output: JSON lines, simple key=value lines, or a tqdm bar on a terminal."""

    def __init__(self, log_format: str | None, total: int | None, enabled: bool):
        self.enabled = enabled
        self.format = log_format or ("tqdm" if sys.stdout.isatty() else "json")
        self.bar = None
        if enabled and self.format == "tqdm":
            self.bar = tqdm(total=total, unit="upd", dynamic_ncols=True)

    def progress(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, record: dict, kind: str = "train") -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix({k: record[k] for k in ("loss", "lr") if k in record}, refresh=False)
            self.bar.write(_simple(kind, record))
        else:
            print(self.line(record, kind), flush=True)

    def line(self, record: dict, kind: str = "train") -> str:
        """``record`` as one line of text: ``kind | key value | ...`` for ``--log-format simple``,
        else strict JSON (what a file holds; the bar's written lines are the simple form)."""
        if self.format == "simple":
            return _simple(kind, record)
        return json.dumps(strict_json({"kind": kind, **record}), allow_nan=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _simple(kind: str, record: dict) -> str:
    """``kind | key value | ...`` as fairseq's simple format prints, with no Python reprs: a
    nested value is one pair per leaf (``memory_bytes_per_rank.0.total_bytes 123``), a list
    of plain values one comma-separated value (an empty one ``none``), None ``null``, a bool
    ``true``/``false``."""
    return " | ".join([kind, *(f"{key} {text}" for name, value in record.items() for key, text in _pairs(name, value))])


def _pairs(key: str, value: Any) -> Iterator[tuple[str, str]]:
    if isinstance(value, (dict, list, tuple)) and not value:
        yield key, "none"
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _pairs(f"{key}.{name}", item)
    elif isinstance(value, (list, tuple)) and any(isinstance(item, (dict, list, tuple)) for item in value):
        for index, item in enumerate(value):
            yield from _pairs(f"{key}.{index}", item)
    elif isinstance(value, (list, tuple)):
        yield key, ",".join(_plain(item) for item in value)
    else:
        yield key, _plain(value)


def _plain(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # a number as its shortest digits (inf, nan included), text as it is
