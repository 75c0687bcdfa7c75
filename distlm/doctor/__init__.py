"""``python -m distlm.doctor``: a preflight of a cluster, run under the training job's own launcher.

Each rank checks what it can see (launch, devices, the save directory, EFA, libfabric,
NCCL's network plugin, all-reduce bandwidth); the ranks exchange their findings over
timed gathers that name any rank that does not arrive, and rank 0 prints one row per
check. Exit status 0 when every check passed, 1 when one failed, 2 for bad input.
"""

from distlm.doctor.cli import main, run
from distlm.doctor.report import FAIL, PASS, SKIP, WARN, Row

__all__ = ["FAIL", "PASS", "Row", "SKIP", "WARN", "main", "run"]
