"""Runs that go wrong end well: divergence stops with one line saying where, log lines stay
strict JSON, and settings that cannot work are refused before anything starts."""

from __future__ import annotations

import datetime
import json
import math

import pytest
import torch

from distlm.backends.cuda import CudaBackend
from distlm.config import OptimConfig, PrecisionConfig, parse_args
from distlm.doctor.cli import main as doctor_main
from distlm.errors import UsageError
from distlm.export.cli import main as export_main
from distlm.training.stats import perplexity
from distlm.observe.printer import strict_json
from distlm.optim import AdamWSettings, build_optimizer
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


def adamw_step(settings: OptimConfig, param_dtype: torch.dtype) -> None:
    """One step of the optimizer training builds from ``settings``, on a gradient of ones."""
    param = torch.nn.Parameter(torch.ones(4, dtype=param_dtype))
    param.grad = torch.ones_like(param)
    build_optimizer([param], AdamWSettings.from_config(settings), param_dtype).step()


def first_step_at_lr(lr: float) -> None:
    settings = OptimConfig(lr=lr)
    for dtype in (torch.float32, torch.float16):  # torch's AdamW, and distlm's fp32-state AdamW
        adamw_step(settings, dtype)


def halvings_into_fp16(scale: float) -> int:
    """Overflowed updates the loss scaler skips, halving ``scale``, before a gradient of 1 fits fp16."""
    halvings = 0
    while not torch.tensor(scale, dtype=torch.float16).isfinite():
        scale, halvings = scale / 2, halvings + 1
    return halvings


# Settings whose huge values passed validation and then overflowed what they are handed
# to, with that consumer: the highest allowed value must go through it.
HIGHEST_ALLOWED = {
    "--timeout-sec": (7 * 24 * 3600.0, lambda value: datetime.timedelta(seconds=value)),
    # A fresh run seeds dropout with seed * 1000 + dp rank; a resume adds 7919 x updates.
    "--seed": (2**32 - 1, lambda value: torch.manual_seed(value * 1000 + 2**20 + 7919 * 10**9)),
    "--bucket-cap-mb": (float(2**20), lambda value: torch.tensor(int(value * 1024 * 1024), dtype=torch.int64)),
    "--lr": (1e30, first_step_at_lr),
    "--end-learning-rate": (1e30, first_step_at_lr),  # the schedule sets it as the optimizer's lr
    "--fp16-init-scale": (2.0**32, lambda value: halvings_into_fp16(value) <= PrecisionConfig().fp16_max_skips),
    "--distributed-world-size": (2**31 - 1, lambda value: torch.tensor(value, dtype=torch.int32)),
    "--encoder-embed-dim": (2**20, lambda value: torch.empty(2**16, value, device="meta")),  # an embedding table
    "--max-positions": (2**24, lambda value: torch.empty(value, 2**20, device="meta")),
}


@pytest.mark.parametrize("flag", sorted(HIGHEST_ALLOWED))
def test_the_highest_value_of_a_setting_fits_where_it_goes_and_more_is_one_line(flag, capsys):
    highest, consume = HIGHEST_ALLOWED[flag]
    assert consume(highest) is not False  # no overflow, nor an answer that says it does not fit
    parse_args([flag, repr(highest)])
    above = highest * 2 if isinstance(highest, int) else highest * 10
    assert main([flag, repr(above)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    shown = str(int(highest)) if float(highest).is_integer() and highest < 2**53 else f"{highest:g}"
    assert len(lines) == 1 and lines[0].startswith(f"distlm: error: {flag} must be in "), lines
    assert lines[0].endswith(f", {shown}], got {above}") or lines[0].endswith(f", {shown}], got {float(above)}"), lines


@pytest.mark.parametrize("argv, named", [
    (["--allreduce-mib", "inf"], "--allreduce-mib 'inf': inf MiB is not a positive size from 4 bytes to 16384 MiB"),
    (["--allreduce-mib", "1,nan"], "--allreduce-mib '1,nan': nan MiB is not a positive size"),
    (["--allreduce-mib", "1e300"], "--allreduce-mib '1e300': 1e300 MiB is not a positive size"),
    (["--allreduce-repeats", str(10**30)], "--allreduce-repeats must be in [1, 10000]"),
    (["--timeout-sec", "1e15"], "--timeout-sec must be in (0, 604800]"),
])
def test_doctor_numbers_out_of_range_are_one_line_and_status_2(argv, named, capsys):
    assert doctor_main(["--device", "cpu", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distlm.doctor: error: ") and named in lines[0], lines


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
