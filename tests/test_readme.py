"""The README's first two commands are the promised ones, and CI runs exactly the second.

(a) install, then the torchrun demo; (b) install, then the test suite. Both pin
torch==2.13.0, because an unpinned torch resolves to a multi-GB CUDA build.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PIN = "torch==2.13.0"
DEMO = "torchrun --nproc_per_node 2 -m distlm.train"
TESTS = "python -m pytest"


def fenced_bash_commands(markdown: str) -> list[str]:
    """Commands of the ```bash blocks in order: comments and blank lines dropped, continuations joined."""
    commands = []
    for block in re.findall(r"^```bash[ \t]*\n(.*?)^```", markdown, flags=re.M | re.S):
        pending = ""
        for line in block.splitlines():
            stripped = line.strip()
            if not pending and (not stripped or stripped.startswith("#")):
                continue
            if stripped.endswith("\\"):
                pending += stripped[:-1].strip() + " "
                continue
            commands.append(pending + stripped)
            pending = ""
    return commands


@pytest.fixture(scope="module")
def readme_commands() -> list[str]:
    commands = fenced_bash_commands((ROOT / "README.md").read_text())
    assert len(commands) >= 2, commands
    return commands[:2]


def split_install(command: str) -> tuple[list[str], str]:
    """``[apt-get ... &&] pip install ... && REST`` -> (pip's words, REST)."""
    steps = [step.strip() for step in command.split(" && ")]
    pip_steps = [i for i, step in enumerate(steps) if step.startswith("pip install ")]
    assert len(pip_steps) == 1, f"expected one 'pip install' step: {command!r}"
    assert all(step.startswith("apt-get ") for step in steps[: pip_steps[0]]), command
    return shlex.split(steps[pip_steps[0]]), " && ".join(steps[pip_steps[0] + 1 :])


def test_first_command_installs_and_runs_the_torchrun_demo(readme_commands):
    words, rest = split_install(readme_commands[0])
    assert rest == DEMO
    assert PIN in words and words[words.index("-e") + 1] == "."


def test_second_command_installs_openmpi_and_the_test_extras_and_runs_pytest(readme_commands):
    words, rest = split_install(readme_commands[1])
    assert rest == TESTS
    assert PIN in words
    extras = words[words.index("-e") + 1]
    # docs: tests/test_docs.py builds the site with mkdocs-material.
    assert extras.startswith(".[") and {"test", "mpi", "docs"} <= set(extras[2:-1].split(","))
    # The MPI tests run under Debian's OpenMPI, installed by the same command.
    assert "apt-get install -y openmpi-bin libopenmpi-dev" in readme_commands[1]


def test_both_commands_pin_the_cpu_torch(readme_commands):
    for command in readme_commands:
        words, _ = split_install(command)
        torch_requirements = [w for w in words if re.match(r"torch\b", w)]
        assert torch_requirements == [PIN], command


def test_ci_runs_exactly_the_second_command(readme_commands):
    script = ROOT / ".ci" / "run"
    lines = [line.strip() for line in script.read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert readme_commands[1] in commands
    # ... and nothing else that installs or tests (set -e, cd to the repository are fine).
    installs_or_tests = [c for c in commands if {"pip", "pytest"} & set(shlex.split(c))]
    assert installs_or_tests == [readme_commands[1]]
    assert PIN in readme_commands[1]
