"""``python -m distlm.export``: a trained checkpoint becomes one safetensors file under the
single-device model's parameter names, tied weights stored once, bad paths one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from distlm import checkpoint
from distlm.config import parse_args
from distlm.data import load_lm_data
from distlm.data.dictionary import Dictionary
from distlm.export.cli import main
from distlm.models import build_model
from distlm.training.trainer import Trainer

UPDATES = 2


def train_args(data: str, save_dir: Path, arch: str = "roberta_tiny") -> list[str]:
    return [
        "--data", data, "--arch", arch, "--tokens-per-sample", "32", "--batch-size", "4",
        "--lr", "1e-3", "--warmup-updates", "1", "--max-update", str(UPDATES), "--log-interval", "1000",
        "--save-dir", str(save_dir), "--device", "cpu", "--seed", "2",
    ]


@pytest.fixture(scope="module", params=["roberta_tiny", "llama_tiny"])
def trained(request, data_dir, tmp_path_factory) -> tuple[str, Path]:  # noqa: F811 - pytest fixture
    """(arch, checkpoint_last.pt) after a few single-process updates."""
    save_dir = tmp_path_factory.mktemp(request.param)
    Trainer(parse_args(train_args(data_dir, save_dir, request.param))).fit()
    return request.param, save_dir / checkpoint.LAST


def metadata_of(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_export_holds_the_checkpoint_under_single_device_names(trained, tmp_path, capsys):
    arch, ckpt = trained
    out = tmp_path / "nested" / "model.safetensors"  # the directory is created
    assert main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"

    state = checkpoint.load(ckpt)
    weights = load_file(str(out))
    # Every tensor is the checkpoint's, bit for bit and in its dtype.
    assert weights.keys() == state["model"].keys()
    for name, value in state["model"].items():
        assert weights[name].dtype == value.dtype, name
        assert torch.equal(weights[name], value), name

    # The names are the single-device model's own: no DDP or compile prefixes.
    assert not [n for n in weights if n.startswith(("module.", "_orig_mod.")) or "._orig_mod." in n]
    dictionary = Dictionary.from_symbols(state["dictionary"])
    model = build_model(arch, vocab_size=len(dictionary), padding_idx=dictionary.pad())
    assert sorted(weights) == sorted(name for name, _ in model.named_parameters())
    model.load_state_dict(weights, strict=True)  # the file is directly usable

    metadata = metadata_of(out)
    assert metadata["arch"] == arch
    assert metadata["task"] == {"roberta_tiny": "masked_lm", "llama_tiny": "causal_lm"}[arch]
    assert json.loads(metadata["dictionary"]) == state["dictionary"] == list(dictionary.symbols)
    assert metadata["num_updates"] == str(UPDATES)
    # Neither built-in model registers a tied weight twice (roberta passes its
    # embedding to the LM head at call time), so there is no alias to list.
    assert json.loads(metadata["tied_weights"]) == {}


class TiedLM(torch.nn.Module):
    """A user model whose output projection is registered as the embedding itself."""

    task = "causal_lm"
    max_positions = 64
    padding_idx = 1

    def __init__(self, vocab_size: int, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def init_weights(self) -> None:
        self.embed.reset_parameters()
        self.norm.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(input_ids)))


def test_tied_weights_are_stored_once_and_their_alias_listed(data_dir, tmp_path):  # noqa: F811
    data = load_lm_data(data_dir, split="train", task="causal_lm", tokens_per_sample=32)
    torch.manual_seed(0)
    model = TiedLM(len(data.dictionary))
    initial = model.embed.weight.detach().clone()
    config = parse_args(train_args(data_dir, tmp_path / "ckpt") + ["--task", "causal_lm"])
    Trainer(config, model=model, train_data=data).fit()
    ckpt = tmp_path / "ckpt" / checkpoint.LAST
    state = checkpoint.load(ckpt)
    assert state["model"].keys() == {"embed.weight", "norm.weight", "norm.bias", "head.weight"}

    out = tmp_path / "tied.safetensors"
    assert main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    weights = load_file(str(out))
    assert sorted(weights) == sorted(name for name, _ in TiedLM(len(data.dictionary)).named_parameters())
    assert sorted(weights) == ["embed.weight", "norm.bias", "norm.weight"]
    metadata = metadata_of(out)
    assert json.loads(metadata["tied_weights"]) == {"head.weight": "embed.weight"}
    assert metadata["arch"] == "TiedLM" and metadata["task"] == "causal_lm"
    for alias, target in json.loads(metadata["tied_weights"]).items():
        assert torch.equal(weights[target], state["model"][alias])
    for name, value in weights.items():
        assert torch.equal(value, state["model"][name]), name
    # The trained tensor, not the initial one, and still a single tensor in the model.
    assert not torch.equal(weights["embed.weight"], initial)
    assert model.head.weight is model.embed.weight


def test_bad_checkpoint_paths_are_one_line_errors_in_process(tmp_path, capsys):
    missing = tmp_path / "nope" / "checkpoint_last.pt"
    out = tmp_path / "x.safetensors"
    assert main(["--checkpoint", str(missing), "--out", str(out)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("distlm.export: error:") and str(missing) in lines[0], lines
    assert not out.exists()

    corrupt = tmp_path / "checkpoint_last.pt"
    corrupt.write_bytes(b"not a checkpoint")
    assert main(["--checkpoint", str(corrupt), "--out", str(out)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and str(corrupt) in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("trained", ["roberta_tiny"], indirect=True)  # one arch is enough here
def test_export_as_a_process_exit_codes(trained, tmp_path):
    """The module's own entry point: exit 0 with the file written; exit 2 and one line for a missing path."""
    _, ckpt = trained
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "model.safetensors"
    missing = tmp_path / "missing.pt"
    commands = {
        "ok": ["--checkpoint", str(ckpt), "--out", str(out)],
        "missing": ["--checkpoint", str(missing), "--out", str(tmp_path / "never.safetensors")],
    }
    # Both processes at once: each spends most of its time importing torch.
    procs = {
        key: subprocess.Popen([sys.executable, "-m", "distlm.export", *argv], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for key, argv in commands.items()
    }
    results = {key: (proc, *proc.communicate(timeout=120)) for key, proc in procs.items()}

    proc, stdout, stderr = results["ok"]
    assert proc.returncode == 0, stderr
    assert stdout.strip() == f"wrote {out}"
    weights = load_file(str(out))
    state = checkpoint.load(ckpt)
    assert weights.keys() == state["model"].keys()
    assert all(torch.equal(weights[name], value) for name, value in state["model"].items())

    proc, stdout, stderr = results["missing"]
    assert proc.returncode == 2
    assert "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0] == f"distlm.export: error: --checkpoint {missing}: no such file", lines
    assert not (tmp_path / "never.safetensors").exists()


@pytest.mark.parametrize("trained", ["roberta_tiny"], indirect=True)
def test_out_that_is_a_directory_is_a_one_line_error(trained, tmp_path, capsys):
    _, ckpt = trained
    assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "--out" in lines[0] and str(tmp_path) in lines[0], lines


# ------------------------------------------------------- what an export may touch


def checkpoint_with_tokenizer_links(ckpt: Path, root: Path) -> Path:
    """A copy of ``ckpt`` whose tokenizer/ holds a real file, a link to a file outside the
    checkpoint (a secret of this machine) and a subdirectory."""
    copy = root / "shared_checkpoint"
    shutil.copytree(ckpt, copy)
    tokenizer = copy / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    (tokenizer / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    secret = root / "secret.txt"
    secret.write_text("SECRET-KEY")
    (tokenizer / "vocab.json").symlink_to(secret)
    (tokenizer / "nested").mkdir()
    return copy


@pytest.mark.parametrize("trained", ["roberta_tiny"], indirect=True)
def test_hf_export_copies_only_regular_files_and_refuses_foreign_directories(trained, tmp_path, capsys, caplog):
    _, ckpt = trained
    shared = checkpoint_with_tokenizer_links(ckpt, tmp_path)
    out = tmp_path / "hf"
    # Verified, the files added after the save are refused (test_checkpoint_trust.py); read as
    # it is, the copy itself keeps the link and the directory out.
    assert main(["--checkpoint", str(shared), "--hf", str(out), "--no-verify-checkpoint"]) == 0
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 32}'
    assert not (out / "vocab.json").exists() and not (out / "nested").exists()
    assert not any("SECRET" in path.read_text(errors="replace") for path in out.iterdir())
    assert "left out nested, vocab.json (only regular files inside the checkpoint are exported)" in caplog.text

    # Another model's directory is not replaced without --overwrite; a distlm export is.
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    capsys.readouterr()
    assert main(["--checkpoint", str(ckpt), "--hf", str(other)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"distlm.export: error: --hf {other} holds files that are not a distlm export (e.g. config.json); name a new "
        "or empty directory, or pass --overwrite to replace the directory and all it holds"]
    assert [p.name for p in other.iterdir()] == ["config.json"]
    assert main(["--checkpoint", str(ckpt), "--hf", str(other), "--overwrite"]) == 0
    assert (other / "model.safetensors").is_file()
    assert main(["--checkpoint", str(ckpt), "--hf", str(out)]) == 0  # an earlier export: replaced

    # The same for --out: a file that is not a distlm export is not replaced.
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(b"not a model")
    capsys.readouterr()
    assert main(["--checkpoint", str(ckpt), "--out", str(foreign)]) == 2
    assert len(error_lines(capsys.readouterr().err)) == 1 and foreign.read_bytes() == b"not a model"


@pytest.mark.parametrize("trained", ["roberta_tiny"], indirect=True)
def test_an_export_follows_the_umask(trained, tmp_path):
    """Teammates read an export as they read any file the user writes: its directory is not
    left with the 0700 of the temporary directory it was written in."""
    _, ckpt = trained
    previous = os.umask(0o027)
    try:
        assert main(["--checkpoint", str(ckpt), "--hf", str(tmp_path / "hf")]) == 0
        assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "model.safetensors")]) == 0
    finally:
        os.umask(previous)
    files = [*(tmp_path / "hf").iterdir(), tmp_path / "model.safetensors"]
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o750
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in files} == {path.name: 0o640 for path in files}


KILLED_EXPORT = """
import os, signal, sys
from distlm.models.hf import io
from distlm.export.cli import main

def die(*args, **kwargs):  # after the weights are written, before config.json
    os.kill(os.getpid(), signal.SIGKILL)

io.write_json = die
main(sys.argv[1:])
"""


@pytest.mark.parametrize("trained", ["roberta_tiny"], indirect=True)
def test_a_killed_export_leaves_the_previous_export_loadable(trained, tmp_path):
    import transformers  # only here: importing it takes seconds

    _, ckpt = trained
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(ckpt), "--hf", str(out)]) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KILLED_EXPORT, "--checkpoint", str(ckpt), "--hf", str(out)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert transformers.AutoModelForMaskedLM.from_pretrained(out) is not None
    abandoned = list(tmp_path.glob(".hf.*.partial"))
    assert len(abandoned) == 1 and (abandoned[0] / "model.safetensors").is_file()
    # The next export removes what the killed one left.
    assert main(["--checkpoint", str(ckpt), "--hf", str(out)]) == 0
    assert not list(tmp_path.glob(".hf.*"))


@pytest.mark.parametrize("trained", ["roberta_tiny"], indirect=True)
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a read-only /proc")
def test_out_on_a_location_that_cannot_be_written_is_one_line(trained, capsys):
    _, ckpt = trained
    for flag, target in (("--out", "/proc/model.safetensors"), ("--hf", "/proc/distlm-export")):
        assert main(["--checkpoint", str(ckpt), flag, target]) == 2
        lines = error_lines(capsys.readouterr().err)
        assert len(lines) == 1 and lines[0].startswith(f"distlm.export: error: {flag} {target}: cannot write"), lines
