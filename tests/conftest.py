"""Shared test setup: one thread per process, markers, and no launcher variables leaking in.

Distributed tests spawn real gloo processes (see ``tests/distributed.py``); two of them
already fill this machine's two cores, so each process uses a single intra-op thread.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEPID",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
)


def pytest_configure(config):
    for name, why in (
        ("gpu", "needs a CUDA GPU"),
        ("neuron", "needs AWS Trainium / torch-neuronx"),
        ("xla", "needs torch-xla (its own environment, PJRT_DEVICE=CPU): python -m pytest -m xla tests/test_xla.py"),
        ("mpi", "needs OpenMPI and mpi4py; run under mpiexec"),
        ("slow", "longer end-to-end runs"),
    ):
        config.addinivalue_line("markers", f"{name}: {why}")


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch):
    """Tests decide the launcher; a developer's shell under Slurm/torchrun must not."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
