"""Gradient all-reduce over MPI (mpi4py), for ``--comm-transport mpi`` under ``mpiexec``.

``MPITransport(comm).all_reduce_sum(tensor)`` (a ``Transport`` of parallel/comm_hooks.py)
sums ``tensor`` in place over an mpi4py communicator and returns a ``torch.futures.Future``
of it, so DDP keeps computing backward while buckets travel; the process group still
carries everything else.

* Each transport owns one communication thread, the only one that calls MPI for it: the
  caller queues the tensor and returns, the thread sums it and resolves the future.
  ``nonblocking=False`` (default) runs one blocking ``Allreduce(IN_PLACE)`` per request,
  in order; ``nonblocking=True`` keeps up to ``max_in_flight`` ``Iallreduce`` outstanding
  (more of them left gloo traffic in the same process hung). benchmarks/README.md has the
  timings behind the default.
* One transport needs ``MPI_THREAD_SERIALIZED``, several ``MPI_THREAD_MULTIPLE``; the level
  granted is checked when a transport is built.
* Collectives start in call order (the queue fixes it), which every rank must share, as
  DDP's bucket order is. The tensor must not be touched before its future resolves, and
  ``then`` callbacks run on the communication thread: pure computation only.
* fp32, fp64, int32 and int64 use MPI's types; fp16 and bf16 use ``MPI_FLOAT16_T`` /
  ``MPI_BFLOAT16_T`` where defined, else travel as 16-bit words with a sum in the half
  type itself (OpenMPI 4.1). Other dtypes are refused.
* CUDA tensors go to MPI only when the build is CUDA-aware; otherwise the transport is
  refused on CUDA. MPI calls have no timeout: mpiexec ends the job when a rank dies.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import re
import shutil
import subprocess
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from distlm.errors import UsageError

INSTALL_HINT = "pip install 'distlm[mpi]' (or pip install mpi4py) and an MPI library such as OpenMPI"

# Variables an MPI process manager exports to every rank it starts: OpenMPI's mpiexec,
# MPICH/Intel MPI's Hydra (and srun --mpi=pmi2), PMIx-based launchers.
MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")

THREAD_LEVEL_NAMES = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED", 2: "MPI_THREAD_SERIALIZED", 3: "MPI_THREAD_MULTIPLE"}
# Standard MPI ordering: SINGLE < FUNNELED < SERIALIZED < MULTIPLE (the constants are
# 0..3 in OpenMPI and MPICH; mpi4py exposes the library's values, compared as such).


# --------------------------------------------------------------------------- pure checks


def import_mpi4py():
    """The ``mpi4py`` package (not yet ``mpi4py.MPI``, whose import initialises MPI), or UsageError."""
    try:
        import mpi4py
    except ImportError:
        raise UsageError(f"--comm-transport mpi needs mpi4py, which is not installed: {INSTALL_HINT}") from None
    return mpi4py


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return any(name in environ for name in MPI_LAUNCH_VARIABLES)


def check_mpi_launch(environ: Mapping[str, str] | None = None) -> None:
    """UsageError unless an MPI launcher started this process (checked before MPI is initialised)."""
    if not launched_by_mpi(environ):
        raise UsageError(
            "--comm-transport mpi needs the ranks to be started by MPI: "
            "mpiexec -n N python -m distlm.train ... (none of "
            f"{', '.join(MPI_LAUNCH_VARIABLES)} is set); or use --comm-transport torch"
        )


def required_thread_level(live_transports: int, MPI: Any) -> int:
    """SERIALIZED while this process has one transport, MULTIPLE once several threads may call MPI."""
    return MPI.THREAD_SERIALIZED if live_transports <= 1 else MPI.THREAD_MULTIPLE


def check_thread_level(provided: int, required: int) -> None:
    """UsageError when MPI was initialised with less thread support than the transport relies on."""
    if provided < required:
        have = THREAD_LEVEL_NAMES.get(provided, str(provided))
        need = THREAD_LEVEL_NAMES.get(required, str(required))
        raise UsageError(
            f"MPI provides thread level {have}, but --comm-transport mpi needs {need} "
            "(its communication thread calls MPI while the main thread trains). "
            "mpi4py requests MPI_THREAD_MULTIPLE unless told otherwise: unset MPI4PY_RC_THREAD_LEVEL "
            "or set it to 'multiple', and use an MPI library built with thread support"
        )


def parse_ompi_info_cuda(text: str) -> bool | None:
    """``ompi_info --parsable --all`` output -> was OpenMPI built with CUDA support (None: not said)."""
    match = re.search(r"^mca:mpi:base:param:mpi_built_with_cuda_support:value:(\w+)\s*$", text, re.MULTILINE)
    if match is None:
        match = re.search(r"^mca:opal:base:param:opal_built_with_cuda_support:value:(\w+)\s*$", text, re.MULTILINE)
    if match is None:
        return None
    return match.group(1).lower() in ("true", "1", "yes")


def query_cuda_support(MPI: Any) -> bool | None:
    """Whether this MPI accepts CUDA device buffers: True, False, or None when it cannot tell."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - an MPI without the MPIX extension raises NotImplementedError
            pass
    ompi_info = shutil.which("ompi_info")
    if ompi_info is None:
        return None
    try:
        out = subprocess.run([ompi_info, "--parsable", "--all"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_ompi_info_cuda(out)


def decide_device_buffers(device_type: str, cuda_support: bool | None) -> bool:
    """Whether MPI is handed device buffers (True) or host buffers (False); UsageError where neither works.

    ``cuda_support`` is the MPI build's answer (``query_cuda_support``). distlm never stages
    CUDA gradients through host memory behind the user's back: without a CUDA-aware MPI,
    CUDA training keeps NCCL (--comm-transport torch).
    """
    if device_type == "cpu":
        return False
    if device_type == "cuda":
        if cuda_support is True:
            return True
        why = "is not CUDA-aware" if cuda_support is False else "does not say whether it is CUDA-aware"
        raise UsageError(
            f"--comm-transport mpi on --device cuda needs a CUDA-aware MPI, and this MPI build {why} "
            "(ompi_info: mpi_built_with_cuda_support); use --comm-transport torch (NCCL) or a CUDA-aware MPI"
        )
    raise UsageError(f"--comm-transport mpi supports --device cpu and cuda, not {device_type}; use --comm-transport torch")


# --------------------------------------------------------------------------- dtypes


def _native_type(MPI: Any, name: str) -> Any | None:
    """An optional MPI datatype (e.g. ``FLOAT16_T``), or None when this library does not define it."""
    datatype = getattr(MPI, name, None)
    if datatype is None or datatype == MPI.DATATYPE_NULL:
        return None
    try:
        datatype.Get_size()  # OpenMPI 4.1: MPI_ERR_TYPE for the MPIX half types mpi4py names
    except Exception:  # noqa: BLE001 - MPI.Exception, NotImplementedError
        return None
    return datatype


# MPI calls these on the communication thread with raw buffers of 16-bit words (the
# reduction of two ranks' segments); torch adds two half tensors with one rounding of the
# exact sum, as a native MPI_SUM on a half type does (inf on overflow, NaN kept).
def _sum_float16(inbuf, outbuf, datatype) -> None:
    torch.frombuffer(outbuf, dtype=torch.float16).add_(torch.frombuffer(inbuf, dtype=torch.float16))


def _sum_bfloat16(inbuf, outbuf, datatype) -> None:
    torch.frombuffer(outbuf, dtype=torch.bfloat16).add_(torch.frombuffer(inbuf, dtype=torch.bfloat16))


@dataclass(frozen=True)
class WireFormat:
    """How one torch dtype goes over MPI: the numpy view of the buffer, the MPI type, the op."""

    view_dtype: torch.dtype  # the tensor is viewed as this dtype before .numpy()
    datatype: Any
    op: Any
    native: bool  # the MPI library's own type and MPI.SUM (False: 16-bit words + our op)


def wire_formats(MPI: Any) -> dict[torch.dtype, WireFormat]:
    """The dtypes this MPI can sum, and how. Creates the user-defined half ops when needed."""
    formats = {
        torch.float32: WireFormat(torch.float32, MPI.FLOAT, MPI.SUM, True),
        torch.float64: WireFormat(torch.float64, MPI.DOUBLE, MPI.SUM, True),
        torch.int32: WireFormat(torch.int32, MPI.INT32_T, MPI.SUM, True),
        torch.int64: WireFormat(torch.int64, MPI.INT64_T, MPI.SUM, True),
    }
    for dtype, name, fallback in (
        (torch.float16, "FLOAT16_T", _sum_float16),
        (torch.bfloat16, "BFLOAT16_T", _sum_bfloat16),
    ):
        native = _native_type(MPI, name)
        if native is not None:
            formats[dtype] = WireFormat(torch.int16, native, MPI.SUM, True)
        else:
            formats[dtype] = WireFormat(torch.int16, MPI.INT16_T, MPI.Op.Create(fallback, commute=True), False)
    return formats


# --------------------------------------------------------------------------- communicators


def split_by_local_rank(comm: Any, local_rank: int) -> Any:
    """The inter-node communicator: ranks of ``comm`` with the same local rank, one per node, by rank.

    Collective over ``comm``: every rank must call it.
    """
    return comm.Split(color=local_rank, key=comm.Get_rank())


def mpi_comm_for_ranks(ranks: Sequence[int], comm: Any = None) -> Any:
    """A communicator over ``ranks`` of ``comm`` (default COMM_WORLD), in that order.

    Collective over the listed ranks only (``MPI_Comm_create_group``), so each rank can
    build the communicator of its own group -- e.g. the one behind a torch ProcessGroup --
    without the others taking part. The whole of ``comm`` gets a duplicate, so the
    transport's traffic never mixes with other users of ``comm``.
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    ranks = [int(r) for r in ranks]
    if comm.Get_rank() not in ranks:
        raise ValueError(f"rank {comm.Get_rank()} is not in the requested group {ranks}")
    if ranks == list(range(comm.Get_size())):
        return comm.Dup()
    group = comm.Get_group().Incl(ranks)
    try:
        return comm.Create_group(group)
    finally:
        group.Free()


# --------------------------------------------------------------------------- transport


@dataclass
class _Job:
    tensor: torch.Tensor
    buffer: Any  # what MPI reads and writes: a numpy view of the tensor, or the CUDA tensor
    wire: WireFormat
    future: torch.futures.Future
    ready: Any = None  # CUDA event recorded after the producer's kernels
    request: Any = None


_STOP = object()


class MPITransport:
    """In-place sum over an mpi4py communicator, completed on this transport's own thread.

    ``MPITransport(comm)``: ``MPI.COMM_WORLD`` (better a ``Dup`` of it) for the flat
    all-reduce, or an inter-node communicator (``split_by_local_rank``) for the
    hierarchical hook's middle leg. ``device_buffers=True`` hands CUDA tensors to a
    CUDA-aware MPI (decided by ``decide_device_buffers``). ``nonblocking`` and
    ``max_in_flight``: see the module docstring. ``thread_level`` overrides
    ``MPI.Query_thread()`` (tests).
    """

    _live: "weakref.WeakSet[MPITransport]" = weakref.WeakSet()
    _live_lock = threading.Lock()

    def __init__(
        self,
        comm: Any,
        *,
        device_buffers: bool = False,
        nonblocking: bool = False,
        max_in_flight: int = 16,
        thread_level: int | None = None,
        MPI: Any = None,
    ):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if MPI is None:
            import_mpi4py()
            from mpi4py import MPI
        self._MPI = MPI
        with MPITransport._live_lock:  # held throughout: the check counts the live threads
            live = len(MPITransport._live) + 1
            provided = MPI.Query_thread() if thread_level is None else thread_level
            check_thread_level(provided, required_thread_level(live, MPI))
            self.comm = comm
            self.size: int = comm.Get_size()
            self.rank: int = comm.Get_rank()
            self.device_buffers = device_buffers
            self.nonblocking = nonblocking
            # Blocking: one request at a time, each future resolved as soon as its sum is done.
            self.max_in_flight = max_in_flight if nonblocking else 1
            self._formats = wire_formats(MPI)
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._failure: BaseException | None = None
            self._closed = False
            self._thread = threading.Thread(target=self._run, name=f"distlm-mpi-transport-{self.rank}", daemon=True)
            self._thread.start()
            MPITransport._live.add(self)

    # ------------------------------------------------------------------ caller side

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Start summing ``tensor`` in place over the communicator; the future resolves to ``tensor``.

        Requests start in call order. Do not read or write ``tensor`` until the future is done.
        """
        wire = self._formats.get(tensor.dtype)
        if wire is None:
            raise UsageError(
                f"--comm-transport mpi cannot sum {tensor.dtype} tensors; it sums "
                f"{', '.join(str(d).replace('torch.', '') for d in self._formats)}"
            )
        if not tensor.is_contiguous():
            raise ValueError("MPITransport.all_reduce_sum needs a contiguous tensor (DDP bucket buffers are)")
        if self._closed:
            raise RuntimeError("MPITransport.all_reduce_sum after close()")
        # A future holding CUDA tensors must name their device (DDP then syncs its streams).
        future: torch.futures.Future = torch.futures.Future(
            devices=[tensor.device] if tensor.device.type == "cuda" else None
        )
        if self._failure is not None:
            future.set_exception(RuntimeError(f"an earlier MPI all-reduce failed: {self._failure}"))
            return future
        ready = None
        if tensor.device.type == "cpu":
            buffer = tensor.detach().view(wire.view_dtype).numpy()
        elif tensor.device.type == "cuda" and self.device_buffers:
            if not wire.native:
                raise UsageError(
                    f"--comm-transport mpi: this MPI has no native {tensor.dtype} type, and the half-precision "
                    "sum distlm adds runs on host buffers only; use fp32 or --comm-transport torch (NCCL) on CUDA"
                )
            buffer = tensor.detach().view(wire.view_dtype)  # mpi4py reads __cuda_array_interface__
            ready = torch.cuda.Event()
            ready.record()  # MPI must not read the bucket before the kernels that fill it finish
        else:
            raise ValueError(
                f"MPITransport got a {tensor.device.type} tensor but was built for host buffers "
                "(device_buffers=False); see decide_device_buffers"
            )
        if self.size == 1:
            future.set_result(tensor)
            return future
        self._queue.put(_Job(tensor, buffer, wire, future, ready))
        return future

    def close(self, timeout: float | None = None) -> None:
        """Finish queued requests and stop the thread (waiting at most ``timeout`` s). Later calls raise."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            with MPITransport._live_lock:
                MPITransport._live.discard(self)

    def __repr__(self) -> str:
        return (
            f"MPITransport(size={self.size}, rank={self.rank}, nonblocking={self.nonblocking}, "
            f"device_buffers={self.device_buffers})"
        )

    # ------------------------------------------------------------- communication thread

    def _run(self) -> None:
        in_flight: collections.deque[_Job] = collections.deque()
        stopping = False
        while True:
            if not in_flight:
                if stopping:
                    return
                item = self._queue.get()  # blocks without holding the GIL or calling MPI
                if item is _STOP:
                    return
                self._issue(item, in_flight)
            # Start what is queued, up to the cap: several collectives progress at once.
            while not stopping and len(in_flight) < self.max_in_flight:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                self._issue(item, in_flight)
            if in_flight:
                job = in_flight.popleft()
                try:
                    if job.request is not None:
                        job.request.Wait()
                except Exception as err:  # noqa: BLE001 - handed to the waiting caller
                    self._fail(job, err, in_flight)
                    continue
                job.future.set_result(job.tensor)

    def _issue(self, job: _Job, in_flight: collections.deque) -> None:
        if self._failure is not None:
            job.future.set_exception(RuntimeError(f"an earlier MPI all-reduce failed: {self._failure}"))
            return
        try:
            if job.ready is not None:
                job.ready.synchronize()
            buffer = [job.buffer, job.wire.datatype]
            if self.nonblocking:
                job.request = self.comm.Iallreduce(self._MPI.IN_PLACE, buffer, op=job.wire.op)
            else:
                self.comm.Allreduce(self._MPI.IN_PLACE, buffer, op=job.wire.op)
        except Exception as err:  # noqa: BLE001
            self._fail(job, err, in_flight)
            return
        in_flight.append(job)

    def _fail(self, job: _Job, err: BaseException, in_flight: collections.deque) -> None:
        """After one failure the communicator's state is unknown: fail this and every later request."""
        self._failure = err
        job.future.set_exception(RuntimeError(f"MPI all-reduce failed on rank {self.rank}: {err}"))
        while in_flight:
            in_flight.popleft().future.set_exception(RuntimeError(f"an earlier MPI all-reduce failed: {err}"))


@atexit.register
def _close_transports_at_exit() -> None:
    """Stop every transport's thread before the interpreter (then mpi4py's MPI_Finalize) shuts down.

    A daemon thread still inside a torch call when Python finalises is killed with
    pthread_exit, which aborts the process ("terminate called without an active
    exception") -- e.g. when it is resolving the future the main thread just saw complete.
    Bounded, so a peer that vanished cannot hold the exit forever.
    """
    for transport in list(MPITransport._live):
        transport.close(timeout=30.0)


# --------------------------------------------------------------------------- wiring


def mpi_transport_factory(
    device_type: str, environ: Mapping[str, str] | None = None, *, nonblocking: bool = False
) -> Callable[[Any], MPITransport]:
    """``factory(group) -> MPITransport`` over the same ranks as the torch ProcessGroup ``group``.

    Checks up front, before any hook runs: mpi4py is installed, an MPI launcher started
    this process, MPI's world is torch's world rank for rank, the device can be served
    (CUDA only with a CUDA-aware MPI). ``group=None`` is the default (world) group.
    Call after ``init_process_group``; every member of ``group`` must call the factory
    for it (the communicator is created collectively over the group's ranks).
    """
    import_mpi4py()
    check_mpi_launch(environ)
    import torch.distributed as dist
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if dist.is_initialized() and (world.Get_size(), world.Get_rank()) != (dist.get_world_size(), dist.get_rank()):
        raise UsageError(
            f"MPI sees rank {world.Get_rank()} of {world.Get_size()} but torch.distributed rank "
            f"{dist.get_rank()} of {dist.get_world_size()}: --comm-transport mpi needs mpiexec to start every rank "
            "(not torchrun or srun inside mpiexec)"
        )
    device_buffers = decide_device_buffers(device_type, query_cuda_support(MPI) if device_type == "cuda" else None)

    def factory(group: Any = None) -> MPITransport:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world.Get_size()))
        return MPITransport(mpi_comm_for_ranks(ranks, world), device_buffers=device_buffers, nonblocking=nonblocking)

    return factory
