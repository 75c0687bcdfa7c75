"""Runs that go wrong end well: divergence stops with one line saying where, log lines stay
strict JSON, and settings that cannot work are refused before anything starts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from distlm.backends.cuda import CudaBackend
from distlm.config import parse_args
from distlm.errors import UsageError
from distlm.export import main as export_main
from distlm.metrics import perplexity, strict_json
from distlm.train import main
from test_ddp import common_args


def run(argv, capsys) -> tuple[int, list[str], list[dict]]:
    code = main(argv)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("distlm: error:")]

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    records = [json.loads(line, parse_constant=refuse) for line in out.splitlines() if line.startswith("{")]
    return code, errors, records


def test_without_a_loss_scaler_a_non_finite_gradient_stops_the_run_naming_the_parameter(data_dir, tmp_path, capsys):
    args = common_args(data_dir, str(tmp_path)) + ["--batch-size", "4", "--warmup-updates", "0", "--lr", "1e20",
                                                   "--max-update", "50", "--clip-norm", "0"]
    code, errors, records = run(args, capsys)
    assert code == 1 and len(errors) == 1, errors
    # The first update applies lr 1e20 to every weight; the next gradient overflows.
    assert errors[0].startswith("distlm: error: update 2: the gradient norm is "), errors
    name = errors[0].split("first non-finite in the gradient of ")[1].split(";")[0]
    assert name == "embed_tokens.weight"  # the first parameter in forward order
    assert "lower --lr" in errors[0]


def test_fp16_stops_after_max_skips_naming_the_module(data_dir, tmp_path, capsys):
    args = common_args(data_dir, str(tmp_path)) + [
        "--batch-size", "4", "--warmup-updates", "0", "--lr", "1e3", "--max-update", "50", "--fp16",
        "--allow-slow-fp16", "--fp16-max-skips", "3", "--log-interval", "1", "--log-format", "json"]
    code, errors, records = run(args, capsys)
    assert code == 1 and len(errors) == 1, errors
    assert "3 fp16 updates in a row overflowed (--fp16-max-skips 3)" in errors[0], errors
    assert "first non-finite: forward output of " in errors[0] or "first non-finite: gradient of " in errors[0]
    # Skipped updates are not logged as updates: no number repeats.
    updates = [record["update"] for record in records if record["kind"] == "train"]
    assert updates == sorted(set(updates))


def test_log_values_are_strict_json_and_perplexity_never_raises():
    assert perplexity(2000.0) == math.inf and perplexity(3.0) == 8.0
    record = strict_json({"loss": math.inf, "ppl": math.nan, "gnorm": -math.inf, "lr": 1e-3, "nested": [math.nan]})
    assert record == {"loss": "inf", "ppl": "nan", "gnorm": "-inf", "lr": 1e-3, "nested": ["nan"]}
    json.dumps(record, allow_nan=False)


@pytest.mark.parametrize("argv, names", [
    (["--lr", "nan"], "--lr"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--adam-betas", "(2.0, 0.9)"], "--adam-betas"),
    (["--adam-eps", "-1"], "--adam-eps"),
    (["--timeout-sec", "nan"], "--timeout-sec"),
    (["--timeout-sec", "inf"], "--timeout-sec"),
    (["--fp16-init-scale", "inf"], "--fp16-init-scale"),
    (["--min-loss-scale", "0"], "--min-loss-scale"),
    (["--clip-norm", "inf"], "--clip-norm"),
    (["--dropout", "1.5"], "--dropout"),
    (["--keep-interval-updates", "-2"], "--keep-interval-updates"),
])
def test_numeric_settings_are_checked_before_anything_starts(argv, names):
    with pytest.raises(UsageError, match=names):
        parse_args(argv)


@pytest.mark.parametrize("toml, names", [
    ('[precision]\nfp16 = "false"\n', "[precision] fp16 = 'false' is a str; it must be true or false"),
    ("[data]\nbatch_size = true\n", "[data] batch_size = True is a bool; it must be an integer"),
    ("[data]\nbatch_size = 2.5\n", "[data] batch_size = 2.5 is a float; it must be an integer"),
    ("[optim]\nwarmup_updates = [1, 2]\n", "[optim] warmup_updates = [1, 2] is a list; it must be an integer"),
    ('data = "DIR"\n', "data is a section; write its settings under [data]"),
    ('tokens_per_sample = 64\n', "tokens_per_sample belongs in section [data]"),
    ("[optim]\nadam_betas = [0.9]\n", "a pair of numbers"),
    ("[optim]\nlr = nan\n", "--lr must be a finite number"),
    ("[nope]\nx = 1\n", "unknown section [nope]"),
])
def test_toml_values_are_checked_against_each_fields_type(tmp_path, toml, names):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(UsageError) as caught:
        parse_args(["--config", str(path)])
    assert names in str(caught.value) and "\n" not in str(caught.value)


def test_a_checkpoint_missing_a_key_is_one_line_in_train_and_export(data_dir, tmp_path, capsys):
    legacy = {"format": 1, "arch": "roberta_tiny", "task": "masked_lm", "model": {}, "rng": [], "world_size": 1,
              "num_updates": 1, "consumed_samples": 8}  # no "optimizer"
    torch.save(legacy, tmp_path / "checkpoint_last.pt")
    code = main([a for a in common_args(data_dir, str(tmp_path)) if a != "--no-save"] + ["--batch-size", "4"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distlm: error:")]
    assert code == 2 and len(errors) == 1 and "'optimizer'" in errors[0] and "checkpoint_last.pt" in errors[0], errors
    assert export_main(["--checkpoint", str(tmp_path / "checkpoint_last.pt"), "--out", str(tmp_path / "m.st")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "'optimizer'" in errors[0], errors


def test_nccl_flight_recorder_dumps_to_the_save_dir_and_never_overrides_the_user(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}
    applied = CudaBackend().record_collectives(str(tmp_path / "comm_traces"), environ)
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "100" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in applied
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "comm_traces" / "rank_")
    assert (tmp_path / "comm_traces").is_dir()
