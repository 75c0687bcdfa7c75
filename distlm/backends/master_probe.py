"""Is it rank 0's rendezvous store that listens at the master address?

A rank other than 0 joins the store rank 0 serves at MASTER_ADDR:MASTER_PORT (or
fairseq's ``--distributed-init-method tcp://HOST:PORT``). When another program holds that
port, rank 0 fails at once (the address is in use), but torch's store client on the
other ranks connects to the foreign program and waits for an answer without any time
limit. So those ranks first wait, up to the timeout, for anything to listen there (rank 0
may start later), and then require a store's answer within ``min(--timeout-sec, 60 s)``:
rank 0's store answers in milliseconds.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time

import torch.distributed as dist

from distlm.errors import UsageError, first_line

ANSWER_LIMIT_SEC = 60.0


def check_master_answers(host: str, port: int, rank: int, timeout_sec: float) -> None:
    """UsageError unless ``host:port`` answers as a PyTorch store; returns silently if nothing
    listens there within ``timeout_sec`` (the store's own timeout then reports it)."""
    deadline = time.monotonic() + timeout_sec
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.2)
    limit = min(timeout_sec, ANSWER_LIMIT_SEC)
    outcome: dict[str, BaseException | None] = {}

    def connect() -> None:
        try:
            # No world size and no waiting for workers: this client is not counted as a rank.
            dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=limit),
                          wait_for_workers=False)
            outcome["error"] = None
        except (dist.DistError, RuntimeError) as err:
            outcome["error"] = err

    # A thread: against a program that accepts and never answers, the client blocks for good.
    thread = threading.Thread(target=connect, name="distlm-master-probe", daemon=True)
    thread.start()
    thread.join(limit + 5.0)
    if "error" in outcome and outcome["error"] is None:
        return
    error = outcome.get("error")
    cause = first_line(error) if error is not None else f"no answer in {limit:g} s"
    raise UsageError(
        f"the master address {host}:{port} is held by a program that is not rank 0's rendezvous store ({cause}); "
        "choose a free port (MASTER_PORT, or --distributed-init-method tcp://HOST:PORT) and check the host"
    )
