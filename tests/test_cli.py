"""Command line: fairseq compatibility, TOML < flags, and one-line errors with exit status 2."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from distlm.config import build_parser, parse_args
from distlm.errors import UsageError
from distlm.train import main

AWS_ROBERTA_RECIPE = (
    "DATABIN --log-format json --log-interval 25 --seed 1 --fp16 --memory-efficient-fp16 --criterion masked_lm "
    "--optimizer adam --lr-scheduler polynomial_decay --task masked_lm --num-workers 2 --max-sentences 8 "
    "--distributed-world-size 16 --distributed-init-method tcp://10.0.0.1:12234 --distributed-rank 3 "
    "--ddp-backend c10d --bucket-cap-mb 200 --fast-stat-sync --arch roberta_large --max-epoch 2 --max-update 500 "
    "--clip-norm 1.0 --update-freq 1 --lr 0.0006 --save-dir DIR --sample-break-mode complete --tokens-per-sample 512"
).split() + ["--adam-betas", "(0.9, 0.98)"] + (
    "--adam-eps 1e-06 --warmup-updates 24000 --total-num-update 500 --dropout 0.1 --attention-dropout 0.1 "
    "--weight-decay 0.01"
).split()


def test_aws_fairseq_recipe_parses_with_fairseq_meanings():
    config = parse_args(AWS_ROBERTA_RECIPE)
    assert config.data.data == "DATABIN"
    assert config.data.batch_size == 8 and config.data.tokens_per_sample == 512
    assert config.data.task == "masked_lm" and config.data.num_workers == 2
    assert config.precision_mode == "memory_efficient_fp16"
    assert config.distributed.strategy == "ddp" and config.distributed.bucket_cap_mb == 200
    assert (config.distributed.distributed_world_size, config.distributed.distributed_rank) == (16, 3)
    assert config.distributed.distributed_init_method == "tcp://10.0.0.1:12234"
    assert config.optim.adam_betas == (0.9, 0.98) and config.optim.adam_eps == 1e-6
    assert (config.optim.max_update, config.optim.max_epoch, config.optim.total_num_update) == (500, 2, 500)
    assert (config.optim.warmup_updates, config.optim.lr, config.optim.clip_norm) == (24000, 6e-4, 1.0)
    assert (config.model.dropout, config.model.attention_dropout, config.optim.weight_decay) == (0.1, 0.1, 0.01)


def test_help_lists_every_config_field():
    text = build_parser().format_help()
    for flag in ("--bucket-cap-mb", "--update-freq", "--clip-norm", "--max-update", "--warmup-updates", "--fp16",
                 "--max-sentences", "--sample-break-mode", "--check-replicas", "--log-format", "--no-save"):
        assert flag in text


def test_toml_is_overridden_by_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('seed = 7\n[optim]\nlr = 0.01\nadam_betas = [0.8, 0.9]\n[data]\nbatch_size = 3\n')
    config = parse_args(["--config", str(toml), "--lr", "0.02"])
    assert config.seed == 7 and config.data.batch_size == 3
    assert config.optim.lr == 0.02 and config.optim.adam_betas == (0.8, 0.9)


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--max-tokens", "0"], "--max-tokens"),
        (["--criterion", "label_smoothed_cross_entropy"], "--criterion"),
        (["--task", "translation"], "--task"),
        (["--fp16", "--bf16"], "--bf16"),
        (["--batch-size", "0"], "--batch-size"),
        (["--adam-betas", "0.9"], "--adam-betas"),
        (["--lr", "fast"], "--lr"),
        (["--ddp-backend", "no_c10d"], "--ddp-backend"),
        (["--max-update", "0"], "--max-update"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv, names):
    with pytest.raises(UsageError, match=names):
        parse_args(argv)


def run_main(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("distlm: error:")]
    return code, lines


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--arch", "roberta_huge"], "--arch roberta_huge"),
        (["--data", "/nonexistent/databin"], "/nonexistent/databin"),
        (["--tokens-per-sample", "100000"], "--tokens-per-sample"),
        (["--device", "cuda"], "cuda"),
        (["--device", "neuron"], "neuron"),
        (["--batch-size", "100000"], "--batch-size"),
        (["--tp-degree", "2"], "--tp-degree 2"),
        (["--dp-degree", "2"], "--dp-degree 2"),
        (["--strategy", "fsdp", "--cpu-offload"], "--cpu-offload"),
        (["--strategy", "fsdp", "--comm-hook", "fp16"], "--comm-hook"),
        (["--sequence-parallel"], "--sequence-parallel"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, expected, data_dir, tmp_path, capsys):
    base = ["--data", data_dir, "--save-dir", str(tmp_path), "--max-update", "1", "--device", "cpu"]
    code, lines = run_main(base + argv, capsys)
    assert code == 2
    assert len(lines) == 1 and expected in lines[0], lines


def test_save_dir_of_another_arch_is_refused_and_left_untouched(data_dir, tmp_path, capsys):
    base = ["--data", data_dir, "--save-dir", str(tmp_path), "--max-update", "1", "--device", "cpu",
            "--tokens-per-sample", "32", "--batch-size", "2"]
    assert main(base + ["--arch", "roberta_tiny"]) == 0
    before = tree_digest(tmp_path / "checkpoint_last")
    capsys.readouterr()
    code, lines = run_main(base + ["--arch", "llama_tiny"], capsys)
    assert code == 2 and len(lines) == 1 and "--save-dir" in lines[0], lines
    assert tree_digest(tmp_path / "checkpoint_last") == before


def tree_digest(directory) -> str:
    """One hash over every file's name and bytes under ``directory``."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def test_corrupt_checkpoint_is_a_one_line_error(data_dir, tmp_path, capsys):
    (tmp_path / "checkpoint_last.pt").write_bytes(b"not a checkpoint")
    code, lines = run_main(["--data", data_dir, "--save-dir", str(tmp_path), "--max-update", "1"], capsys)
    assert code == 2 and len(lines) == 1 and "checkpoint_last.pt" in lines[0], lines


def test_entry_point_process_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "distlm.train", "--arch", "nope"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("distlm: error: --arch nope")


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_example_configs_parse():
    configs = sorted(EXAMPLES.glob("*.toml"))
    assert configs
    for path in configs:
        parse_args(["--config", str(path)])


def test_the_roberta_large_config_holds_the_recipes_settings():
    """examples/roberta_large.toml plus the sbatch recipe's --fp16 --memory-efficient-fp16
    equal AWS's command line in every setting but where the processes come from."""
    recipe = parse_args(AWS_ROBERTA_RECIPE).to_dict()
    config = parse_args(["DATABIN", "--config", str(EXAMPLES / "roberta_large.toml"), "--fp16",
                         "--memory-efficient-fp16", "--save-dir", "DIR", "--seed", "1"]).to_dict()
    launch = {"distributed_world_size", "distributed_rank", "distributed_init_method"}
    for section, values in recipe.items():
        if not isinstance(values, dict):
            assert config[section] == values, section
            continue
        for name, value in values.items():
            if name not in launch:
                assert config[section][name] == value, f"{section}.{name}"


@pytest.mark.parametrize(
    "arch, tp, expected",
    [("llama_tiny", 4, "--tp-degree 4 does not divide n_heads 6"), ("llama_tiny", 3, "--tp-degree 3 neither divides nor is a multiple of n_kv_heads 2")],
)
def test_tp_degree_the_model_cannot_split_fails_before_the_rendezvous(arch, tp, expected, data_dir, tmp_path,
                                                                       monkeypatch, capsys):
    """Rank 0 of a 12-rank torchrun job whose peers never come: the error must come first,
    not a rendezvous timeout (nothing listens on the master port)."""
    from test_env import torchrun_env

    env = torchrun_env(rank=0, WORLD_SIZE="12", LOCAL_WORLD_SIZE="4", GROUP_WORLD_SIZE="3",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["--data", data_dir, "--save-dir", str(tmp_path), "--device", "cpu", "--arch", arch,
            "--tp-degree", str(tp), "--timeout-sec", "5"]
    code, lines = run_main(argv, capsys)
    assert code == 2
    assert len(lines) == 1 and expected in lines[0], lines
