"""Shared test setup: one thread per process, markers, no launcher variables leaking in,
and the small data directory most tests train on.

Distributed tests spawn real gloo processes (see ``tests/distributed.py``); two of them
already fill this machine's two cores, so each process uses a single intra-op thread.
"""

import os

import numpy as np
import pytest

from distlm.data.indexed_dataset import write_indexed_dataset

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
        ("cluster", "simulated nodes in network namespaces (tests/cluster.py); needs root, iproute2 and nftables"),
    ):
        config.addinivalue_line("markers", f"{name}: {why}")


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch):
    """Tests decide the launcher; a developer's shell under Slurm/torchrun must not."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """A small fairseq-preprocess style directory: 40-symbol vocabulary, 400 sentences."""
    root = tmp_path_factory.mktemp("databin")
    rng = np.random.default_rng(0)
    words = 40
    (root / "dict.txt").write_text("".join(f"w{i} {1000 - i}\n" for i in range(words)))
    sentences = [np.append(rng.integers(4, 4 + words, size=rng.integers(4, 30)), 2) for _ in range(400)]
    write_indexed_dataset(str(root / "train"), sentences, np.uint16)
    write_indexed_dataset(str(root / "valid"), sentences[:20], np.uint16)
    return str(root)
