"""Every rank must train with the same settings on the same data: checked once, at start.

A rank launched with another ``--lr`` or ``--seed`` trains a diverging replica or reads
another order of the data without any error; another ``--arch`` or ``--strategy`` reaches
DDP or FSDP with mismatched collectives, which hang or fail deep inside torch. So right
after the process group starts, before any other collective, every rank hashes its
resolved configuration (minus what is legitimately per rank) and a fingerprint of its
data, and the hashes are gathered: one all-gather of 64 bytes per rank. Only when they
differ are the settings themselves gathered, to name the first that differs and the
ranks holding each value.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from distlm.config import parse_data_sources
from distlm.errors import UsageError, describe_ranks

# Settings that may differ between ranks: the rank itself, host-side loading, the log's
# look and a node-local compile cache. --data is compared by what it holds (the data
# fingerprint), since nodes may keep the same data under different paths.
PER_RANK = frozenset({"distributed_rank", "num_workers", "log_format", "compile_cache", "data"})

# Index files are small next to the token files; a prefix this long identifies them in
# practice, and the recorded size of every file covers the rest. Of the token files a
# shorter prefix is hashed, so that a start with many shards stays quick.
HASHED_PREFIX_BYTES = 64 << 20
HASHED_TOKEN_PREFIX_BYTES = 1 << 20


def fingerprint_data(path: str | None) -> str:
    """One hash of what a data directory holds (``data_files``), as text."""
    if path is None:
        return "the built-in corpus"
    files = data_files(path)
    if files is None:
        return "no such directory"
    return f"contents {hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]}"


def data_files(path: str | None) -> dict[str, str] | None:
    """Each file of a data directory, by name: its size and a hash of its head (the whole
    dictionary and index files, in practice). None for the built-in corpus or no directory.

    Kept in every checkpoint, so a resume notices data replaced under the same path. A
    mixture's are each source's, named ``source I/FILE``, and each source's weight."""
    sources = parse_data_sources(path)
    if sources is not None:
        # By position, not path: nodes may keep the same sources under different paths.
        files: dict[str, str] = {}
        for index, (weight, directory) in enumerate(sources):
            each = data_files(directory)
            if each is None:
                return None
            files[f"source {index} weight"] = repr(weight)
            files.update({f"source {index}/{name}": entry for name, entry in each.items()})
        return files
    if path is None or not Path(path).is_dir():
        return None
    entries = tuple((entry.name, entry.stat()) for entry in sorted(Path(path).iterdir()) if entry.is_file())
    return _data_files(str(path), tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in entries))


@functools.lru_cache(maxsize=64)
def _data_files(path: str, stats: tuple[tuple[str, int, int, int], ...]) -> dict[str, str]:
    """``data_files`` of the directory as ``stats`` saw it: the agreement at start and every
    save read the files once, and a file rewritten since is read again. Room for one entry
    per source of a large mixture, each a few hashes."""
    files = {}
    for name, size, _, _ in stats:
        limit = HASHED_PREFIX_BYTES if name.endswith((".txt", ".idx", ".json")) else HASHED_TOKEN_PREFIX_BYTES
        with open(Path(path) / name, "rb") as f:
            files[name] = f"{size} bytes, sha256 {hashlib.sha256(f.read(limit)).hexdigest()[:16]}"
    return files


def shared_settings(config: Any) -> dict[str, str]:
    """The settings every rank must share, by command-line flag, with their values as text."""
    settings: dict[str, str] = {}
    for section, fields in config.to_dict().items():
        for name, value in (fields.items() if isinstance(fields, dict) else [(section, fields)]):
            if name not in PER_RANK:
                settings[f"--{name.replace('_', '-')}"] = json.dumps(value, default=str)
    settings["--data"] = fingerprint_data(config.data.data)
    return settings


def hash_settings(settings: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def find_disagreement(per_rank: list[dict[str, str]], data_paths: list[str | None] | None = None) -> str | None:
    """The first setting the ranks hold different values of, as one line; None if they agree.

    ``data_paths``: each rank's --data, shown beside its fingerprint.
    """
    flags = list(per_rank[0]) + sorted(set().union(*per_rank[1:]) - per_rank[0].keys())
    for flag in flags:
        values: dict[str, list[int]] = {}
        for rank, settings in enumerate(per_rank):
            value = settings.get(flag, "(unset)")
            if flag == "--data" and data_paths is not None:
                value = f"{data_paths[rank]} ({value})"
            values.setdefault(value, []).append(rank)
        if len(values) > 1:
            held = "; ".join(f"{value} on {describe_ranks(ranks)}" for value, ranks in values.items())
            return (f"the ranks were launched with different {flag}: {held}; "
                    "give every rank the same settings and data")
    return None


def check_ranks_agree(config: Any, all_gather_object) -> None:
    """Refuse to train (``UsageError`` on every rank) unless all ranks' settings and data agree.

    ``all_gather_object(obj)`` gathers one object of every rank in rank order (collective).
    """
    settings = shared_settings(config)
    hashes = all_gather_object(hash_settings(settings))
    if len(set(hashes)) == 1:
        return
    gathered = all_gather_object((settings, config.data.data))
    problem = find_disagreement([s for s, _ in gathered], [path for _, path in gathered])
    raise UsageError(problem or "the ranks' settings differ (their hashes do); give every rank the same settings")
