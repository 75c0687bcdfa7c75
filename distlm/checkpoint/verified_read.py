"""Loading a checkpoint's shards while verifying their checksums, so that each byte is read once.

A save records each file's checksum (integrity.py). Verifying the shards before the load
read every shard twice: once whole for its checksum, once more for the tensors. Here the
checksum of a shard file is computed from the very reads that load its tensors.

Each shard file is verified by one rank: the one that reads most of it (ties go to the rank
with the fewest bytes to verify so far), chosen by the coordinator from every rank's read
plan. That rank reads the file from start to end: its own records as DCP loads them, the
bytes in between (other ranks' records, read by them) only for the checksum. A rank loading
its own shards back (the same layout) so reads each of its files once, and one process
resharding a whole checkpoint reads every file once. A file no rank reads is read whole by
a rank with the fewest bytes to verify.

A checksum is over the bytes in file order, but torch.load reads a record out of order
(the zip's directory at its end first, then headers, then the tensor's bytes). A read that
continues where the checksum stands extends it; a read a few bytes ahead first hashes the
gap (the zip's file names and padding, which torch.load skips); a read behind it or far
ahead (the directory) is not hashed then, and the checksum reads those bytes again, from
the page cache, when it reaches them. Large reads are split into pieces that fit a core's
cache, each hashed right after the kernel copied it in.

A file that differs from what was written is named in ``problem`` rather than raised, so
that the loader reports it on every rank whatever else failed: a damaged record may make
torch.load fail on the rank that reads it before the rank verifying the file reaches its end.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from distlm.checkpoint import integrity
from distlm.checkpoint.storage import SafeReader

_PIECE = 1 << 20
"""Bytes read and hashed at a time: the piece is still in the core's cache when it is hashed."""
_GAP = 1 << 16
"""A read at most this far ahead of the checksum hashes the bytes in between first."""


class VerifyingReader(SafeReader):
    """The safe reader (storage.py) that verifies the checksums ``recorded`` for the shard
    files (name -> the save's entry) as it reads them; ``problem`` names a file that differs."""

    def __init__(self, path: str | os.PathLike, recorded: dict[str, dict[str, Any]]):
        super().__init__(str(path))
        self.recorded = recorded
        self.problem: str | None = None

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        return [dataclasses.replace(plan, storage_data=names) for plan, names in zip(plans, self._verifiers(plans))]

    def _verifiers(self, plans: list[LoadPlan]) -> list[list[str]]:
        """The shard files each rank verifies (coordinator)."""
        shards = {info.relative_path for info in self.storage_data.values()} & set(self.recorded)
        read = [Counter() for _ in plans]
        for counter, plan in zip(read, plans):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                counter[info.relative_path] += info.length
        names: list[list[str]] = [[] for _ in plans]
        assigned = [0] * len(plans)
        for name in sorted(shards, key=lambda name: (-self.recorded[name].get("size", 0), name)):
            most = max(counter[name] for counter in read)
            rank = min((rank for rank in range(len(plans)) if read[rank][name] == most),
                       key=lambda rank: (assigned[rank], rank))
            names[rank].append(name)
            assigned[rank] += self.recorded[name].get("size", 0)
        return names

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        mine = set(plan.storage_data or ())
        by_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_file[self.storage_data[item.storage_index].relative_path].append(item)
        others = [item for name, items in by_file.items() if name not in mine for item in items]
        for name in sorted(mine):
            items = by_file.get(name, [])
            if any(self.storage_data[item.storage_index].transform_descriptors for item in items):
                others += items  # DCP's stream extensions, which distlm never writes: DCP reads them
                self._note(integrity.verify(Path(self.path), self.recorded, [name]))
            else:
                self._read_verifying(name, items, planner)
        if others:
            super().read_data(dataclasses.replace(plan, items=others), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _note(self, problem: str | None) -> None:
        self.problem = self.problem or problem

    def _read_verifying(self, name: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Load ``items`` from the shard file ``name``, reading it whole for its checksum."""
        file = Path(self.path) / name
        algorithm = integrity.algorithm_of(self.recorded[name])
        if algorithm is None:
            self._note(integrity.unknown_checksum(file))
            return
        failure: Exception | None = None
        fd = os.open(file, os.O_RDONLY)
        try:
            checksum = _FileChecksum(fd, integrity.ALGORITHMS[algorithm]())
            for item in sorted(items, key=lambda item: self.storage_data[item.storage_index].offset):
                info = self.storage_data[item.storage_index]
                checksum.extend_to(info.offset)
                if failure is None:
                    try:
                        _load_item(_VerifyingView(fd, info.offset, info.length, checksum), item, planner)
                    except Exception as err:  # noqa: BLE001 - damage makes torch.load fail anyhow
                        failure = err
                checksum.extend_to(info.offset + info.length)
            checksum.extend_to(os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if checksum.hexdigest() != self.recorded[name][algorithm]:
            self._note(integrity.differs(file, algorithm))
        elif failure is not None:
            raise failure  # the file is as written: the failure is not damage


def _load_item(stream: io.RawIOBase, item: ReadItem, planner: LoadPlanner) -> None:
    """One record into its place, as DCP's FileSystemReader loads it."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(stream.read()))
        return
    tensor = narrow_tensor_by_index(torch.load(stream, map_location="cpu", weights_only=True),
                                    item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise ValueError(f"{item.storage_index.fqn}: the checkpoint holds {tuple(tensor.size())} for "
                         f"{tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


class _FileChecksum:
    """The checksum of a file's bytes from its start, in order, up to ``end``."""

    def __init__(self, fd: int, hasher: Any):
        self.fd = fd
        self.hasher = hasher
        self.end = 0
        self._buffer: memoryview | None = None

    def saw(self, offset: int, data: memoryview) -> None:
        """Take in the bytes a load read at ``offset`` where they continue the checksum."""
        if self.end < offset <= self.end + _GAP:
            self.extend_to(offset)
        if offset <= self.end < offset + len(data):
            self.hasher.update(data[self.end - offset:])
            self.end = offset + len(data)

    def extend_to(self, offset: int) -> None:
        """Read and hash the bytes up to ``offset`` that no load read in order."""
        if self.end >= offset:
            return
        if self._buffer is None:
            self._buffer = memoryview(bytearray(_PIECE))
        while self.end < offset:
            piece = self._buffer[:min(_PIECE, offset - self.end)]
            count = os.preadv(self.fd, [piece], self.end)
            if count == 0:  # the file ends early: its checksum differs
                return
            self.hasher.update(piece[:count])
            self.end += count

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()


class _VerifyingView(io.RawIOBase):
    """One record of a shard file (``length`` bytes at ``offset``) as a file of its own for
    torch.load, handing every read to the file's checksum."""

    def __init__(self, fd: int, offset: int, length: int, checksum: _FileChecksum):
        super().__init__()
        self._fd, self._offset, self._length, self._checksum = fd, offset, length, checksum
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._length}[whence]
        self._position = base + position
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[:max(0, self._length - self._position)]
        done = 0
        while done < len(view):
            piece = view[done:done + _PIECE]
            at = self._offset + self._position + done
            count = os.preadv(self._fd, [piece], at)
            if count == 0:
                break
            self._checksum.saw(at, piece[:count])
            done += count
        self._position += done
        return done
