"""Ranks and hosts in words, for the one-line messages that name them."""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Iterable, Sequence


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
