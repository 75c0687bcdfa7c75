"""The guide builds, and the commands it marks as runnable run.

- ``mkdocs build --strict`` builds docs/ into a site: a broken link, a missing anchor or a page
  left out of mkdocs.yml's nav fails it.
- Every block that a page marks with ``<!-- runnable -->`` on the line before its fence runs:
  the marked blocks of one page in order, in one scratch directory of their own (a later block
  may use what an earlier one wrote), ``bash`` under ``bash -e``, ``python`` as a script. Each
  must exit with status 0.
- The README's tour runs after the torchrun part of README command (a), in the same directory.

Documented runs are long (``--max-update 200``); SUBSTITUTIONS below shortens them, and each
substitution must still match its page, so the list cannot drift from the docs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from test_readme import fenced_bash_commands, split_install

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKER = "<!-- runnable -->"
LANGUAGES = {"bash", "python"}
BLOCK_TIMEOUT = 240

# (page, text of its runnable blocks, what runs instead). Only run length changes here: fewer
# updates and validation batches, one parity layout of the documented three, one update each.
SUBSTITUTIONS = [
    ("README.md", "config.optim.max_update = 50", "config.optim.max_update = 2\nconfig.data.max_valid_steps = 1"),
    ("README.md", "--max-update 100", "--max-update 4 --max-valid-steps 1"),
    ("docs/watching.md", "--max-update 200 --validate-interval-updates 50",
     "--max-update 2 --validate-interval-updates 1 --log-interval 1 --max-valid-steps 1"),
    ("docs/strategies.md", '--layouts "strategy=ddp,dp=2" "strategy=fsdp,dp=2" "tp=2,', '--layouts "tp=2,'),
    ("docs/strategies.md", "--steps 2", "--steps 1"),
]
# Appended to README command (a)'s torchrun part: the same run, 2 updates long.
COMMAND_A_SHORT = "--max-update 2 --max-valid-steps 1"


def runnable_blocks(markdown: str, where: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block marked runnable, in order.

    Fences are followed as CommonMark does (a block closes at a run of at least as many
    backticks), so a marker shown inside a code block is not a marker.
    """
    lines = markdown.splitlines()
    blocks, markers, i = [], 0, 0
    while i < len(lines):
        line = lines[i]
        opening = re.fullmatch(r"(`{3,})([\w-]*)\s*", line)
        if opening is None:
            markers += line.strip() == MARKER
            i += 1
            continue
        fence, language = opening.groups()
        end = next((j for j in range(i + 1, len(lines)) if re.fullmatch(rf"`{{{len(fence)},}}\s*", lines[j])), None)
        assert end is not None, f"{where}:{i + 1}: a code block that never closes"
        if i > 0 and lines[i - 1].strip() == MARKER:
            assert language in LANGUAGES, f"{where}:{i + 1}: a runnable block must be one of {sorted(LANGUAGES)}"
            blocks.append((language, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    assert markers == len(blocks), f"{where}: {markers - len(blocks)} {MARKER} not on the line before a fence"
    return blocks


def page_blocks(page: str) -> list[tuple[str, str]]:
    """The page's runnable blocks with its substitutions applied; each must match."""
    blocks = runnable_blocks((ROOT / page).read_text(), page)
    for where, old, new in SUBSTITUTIONS:
        if where != page:
            continue
        assert any(old in code for _, code in blocks), f"{page}: substitution {old!r} matches no runnable block"
        blocks = [(language, code.replace(old, new)) for language, code in blocks]
    return blocks


def runnable_pages() -> list[str]:
    return [f"docs/{path.name}" for path in sorted(DOCS.glob("*.md")) if runnable_blocks(path.read_text(), path.name)]


@pytest.fixture(scope="module")
def environment(tmp_path_factory) -> dict[str, str]:
    """This interpreter as ``python`` and ``torchrun``, this checkout's distlm, one corpus cache."""
    root = tmp_path_factory.mktemp("docs_env")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    # --standalone: a rendezvous on a port the OS picks, so concurrent jobs never meet on 29500.
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m torch.distributed.run --standalone "$@"\n')
    torchrun.chmod(0o755)
    return {
        **os.environ,  # conftest.py already removed every launcher variable
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "DISTLM_CACHE_DIR": str(root / "cache"),  # the built-in corpus, built once for the module
        "MPLBACKEND": "Agg",
    }


def run_block(language: str, code: str, cwd: Path, env: dict[str, str], where: str) -> None:
    script = cwd / f".block.{'sh' if language == 'bash' else 'py'}"
    script.write_text(code)
    command = ["bash", "-e", "-o", "pipefail", str(script)] if language == "bash" else [sys.executable, str(script)]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    script.unlink()
    assert done.returncode == 0, f"{where}: exit status {done.returncode}\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("material", reason="the docs extra (mkdocs-material) builds the site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "site" / "watching" / "index.html").is_file()


def test_every_page_is_in_the_nav_and_linked_from_the_readme():
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    pages = sorted(path.name for path in DOCS.glob("*.md"))
    assert sorted(nav) == pages
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)(?:#[\w-]*)?\)", readme))
    assert linked == set(pages) - {"index.md"}


def test_the_marker_is_found_only_before_a_fence():
    markdown = f"text\n{MARKER}\n```bash\necho one\n```\n````markdown\n{MARKER}\n```bash\nno\n```\n````\n```bash\nno\n```\n"
    assert runnable_blocks(markdown, "example") == [("bash", "echo one\n")]
    with pytest.raises(AssertionError, match="not on the line before a fence"):
        runnable_blocks(f"{MARKER}\n\n```bash\necho\n```\n", "example")


def test_pages_with_runnable_blocks():
    """The blocks that matter are marked (a page that loses its marker drops out of the runs)."""
    assert runnable_pages() == ["docs/benchmarks.md", "docs/clusters.md", "docs/strategies.md", "docs/watching.md"]


@pytest.mark.parametrize("page", runnable_pages())
def test_runnable_blocks_of_a_page_run(page, environment, tmp_path):
    blocks = page_blocks(page)
    assert blocks
    for number, (language, code) in enumerate(blocks, 1):
        run_block(language, code, tmp_path, environment, f"{page}, runnable block {number}")


def test_readme_tour_runs_after_command_a_in_the_same_directory(environment, tmp_path):
    """Command (a) trains roberta_tiny into checkpoints/roberta_tiny; the tour's Python example
    trains llama_tiny into checkpoints/llama_tiny, its torchrun line resumes that one under
    FSDP on 2 ranks, and its export reads command (a)'s."""
    _, command_a = split_install(fenced_bash_commands((ROOT / "README.md").read_text())[0])
    run_block("bash", f"{command_a} {COMMAND_A_SHORT}\n", tmp_path, environment, "README command (a)")
    for number, (language, code) in enumerate(page_blocks("README.md"), 1):
        run_block(language, code, tmp_path, environment, f"README.md, runnable block {number}")
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["llama_tiny", "roberta_tiny"]
    # The torchrun line resumed the Python run (2 updates) to its --max-update 4 under FSDP on 2 ranks.
    saved = json.loads((tmp_path / "checkpoints" / "llama_tiny" / "checkpoint_last" / "distlm.json").read_text())
    assert (saved["progress"]["num_updates"], saved["world_size"]) == (4, 2)
    assert saved["config"]["distributed"]["strategy"] == "fsdp"
    assert json.loads((tmp_path / "roberta_tiny_hf" / "config.json").read_text())["model_type"] == "roberta"
