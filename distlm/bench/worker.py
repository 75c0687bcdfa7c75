"""One launch of the scaling suite, as the driver starts it on this machine:

    python -m torch.distributed.run --nproc_per_node N --standalone -m distlm.bench.worker SPEC.json OUT.json

Every rank measures each strategy of the spec (``measure.measure_launch``); rank 0
writes the result to OUT.json and prints progress lines for the driver to show.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from distlm.bench.measure import LaunchSpec, measure_launch
from distlm.errors import UsageError, exit_without_teardown, rank_from_environment, report_usage_error
from distlm.runtime.context import shutdown

PROGRESS_PREFIX = "distlm.bench| "
ERROR_PREFIX = "distlm.bench: error: "


def main(argv: Sequence[str]) -> int:
    """Measure the launch of ``argv = [SPEC.json, OUT.json]``; returns the exit status."""
    if len(argv) != 2:
        print(f"{ERROR_PREFIX}usage: python -m distlm.bench.worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec_path, out_path = map(Path, argv)
    rank = rank_from_environment()

    def progress(line: str) -> None:
        if rank == 0:
            print(PROGRESS_PREFIX + line, flush=True)

    try:
        spec = LaunchSpec.from_json(json.loads(spec_path.read_text()))
        result = measure_launch(spec, progress)
    except UsageError as exc:
        return report_usage_error(ERROR_PREFIX, exc, rank)
    finally:
        shutdown()
    if rank == 0:
        partial = out_path.with_name(out_path.name + ".partial")
        partial.write_text(json.dumps({"spec": spec.to_json(), **result}, indent=1))
        partial.replace(out_path)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
