"""distlm's log lines: their format, and the handler a program that configured no logging of its
own gets, so that a Trainer made in Python logs as the command line does."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"


def use_default_logging(rank: int) -> None:
    """Log distlm's lines as the command line does (INFO on rank 0, warnings elsewhere, to
    stderr) unless the program configured logging itself. Silence them with
    ``logging.getLogger("distlm").setLevel(logging.WARNING)``, before or after."""
    logger = logging.getLogger("distlm")
    if logger.handlers or logging.getLogger().handlers:
        return  # the program's own logging decides
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
