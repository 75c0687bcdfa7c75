"""``python -m distlm.bench SUITE [flags]``; the suites: ``scaling``."""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

from distlm.errors import exit_without_teardown

SUITES = {"scaling": "distlm.bench.scaling"}
USAGE = "usage: python -m distlm.bench {" + ",".join(SUITES) + "} [--help | flags]"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite named first in ``argv``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv or argv[0] not in SUITES:
        named = f"unknown suite {argv[0]!r}; " if argv else ""
        print(f"distlm.bench: error: {named}{USAGE.removeprefix('usage: ')}", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[argv[0]]).main(argv[1:])


def run() -> None:
    """``python -m distlm.bench`` and the ``distlm-bench`` command."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
