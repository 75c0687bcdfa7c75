"""The Python API behaves as the command line does: each model keeps its checkpoints in a
directory of its own by default, errors name the config field beside the flag, and the
start-up lines are logged (and can be silenced) without any logging set up by the program."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distlm import TrainConfig, Trainer
from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.train import main


def tiny(config: TrainConfig, data_dir: str, arch: str) -> TrainConfig:
    config.model.arch = arch
    config.data.data = data_dir
    config.data.tokens_per_sample = 16
    config.data.batch_size = 2
    config.optim.max_update = 1
    config.data.disable_validation = True
    config.distributed.device = "cpu"
    return config


def test_runs_of_two_models_keep_their_checkpoints_apart_by_default(data_dir, tmp_path, monkeypatch):
    """README command (a) trains roberta_tiny, its Python example llama_tiny, in one directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["--data", data_dir, "--tokens-per-sample", "16", "--batch-size", "2", "--max-update", "1",
                 "--disable-validation", "--device", "cpu"]) == 0
    config = tiny(TrainConfig(), data_dir, "llama_tiny")
    Trainer(config).fit()
    assert config.checkpoint.save_dir == str(Path("checkpoints") / "llama_tiny")
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["llama_tiny", "roberta_tiny"]
    assert (tmp_path / "checkpoints" / "llama_tiny" / "checkpoint_last").is_dir()


def test_an_error_of_a_python_config_names_the_field_and_the_command_lines_only_the_flag(data_dir, tmp_path):
    config = tiny(TrainConfig(), data_dir, "llama_tiny")
    config.checkpoint.no_save = True
    config.data.tokens_per_sample = 100_000
    with pytest.raises(UsageError) as raised:
        Trainer(config)
    assert "--tokens-per-sample (config.data.tokens_per_sample) 100000 exceeds" in str(raised.value)
    assert str(raised.value).count("(config.data.tokens_per_sample)") == 1  # its second mention is left as it is
    with pytest.raises(UsageError) as raised:
        Trainer(parse_args(["--arch", "llama_tiny", "--tokens-per-sample", "100000", "--no-save", "--device", "cpu"]))
    assert "--tokens-per-sample 100000 exceeds" in str(raised.value) and "(config." not in str(raised.value)


SCRIPT = """
import logging, sys
from distlm import TrainConfig, Trainer
def run():
    config = TrainConfig()
    config.model.arch, config.data.data, config.optim.max_update = "llama_tiny", sys.argv[1], 1
    config.data.tokens_per_sample, config.data.batch_size, config.distributed.device = 16, 2, "cpu"
    config.data.disable_validation, config.checkpoint.no_save = True, True
    Trainer(config).fit()
logging.getLogger("distlm").setLevel(logging.WARNING)
run()
print("--- now at INFO", file=sys.stderr, flush=True)
logging.getLogger("distlm").setLevel(logging.INFO)
run()
"""


def test_the_python_api_logs_the_start_up_lines_and_a_program_can_silence_them(data_dir, tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, data_dir], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    silenced, logged = done.stderr.split("--- now at INFO")
    assert "| INFO |" not in silenced, silenced
    for line in ("| INFO | distlm | data: ", "| INFO | distlm | model: ", "| INFO | distlm | starting from seed 1"):
        assert line in logged, logged
