"""Seeing inside a run: trackers, --log-file, the profiler window, stragglers and distlm.report.

One 2-rank job (4 updates, rank 1 slowed in its data loading, updates 2-3 profiled) and its
resume in one process from the checkpoint of update 2 up to update 6 (as after a run killed
after that checkpoint) serve every check of a real run.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from distlm.config import parse_args
from distlm.observe.trackers import Trackers, record_tags
from distlm.training.trainer import Trainer
from distlm.train import main

FAIRSEQ_LOG = Path(__file__).parent / "data" / "fairseq_masked_lm_train.log"  # provenance: tests/data/README.md
SLOW_RANK, DATA_DELAY = 1, 0.2


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.levelname} {record.getMessage()}")


class _SlowData(Trainer):
    """Rank SLOW_RANK sleeps before each batch: a straggler in its data loading."""

    def update_batches(self):
        batches = super().update_batches()
        return _slowed(batches) if self.ctx.rank == SLOW_RANK and self.slow else batches


def _slowed(batches):
    """Sleeps twice as long as the last update took (at least DATA_DELAY), so the rank is the
    slowest by far however loaded the machine is."""
    handed = None
    for batch in batches:
        if handed is not None:
            time.sleep(min(max(DATA_DELAY, 2 * (time.perf_counter() - handed)), 3.0))
        else:
            time.sleep(DATA_DELAY)
        handed = time.perf_counter()
        yield batch


def observed_fit(args: list[str], slow: bool) -> dict:
    """Train; return this rank's stdout and distlm log messages."""
    collect = _Collect()
    logger = logging.getLogger("distlm")
    level = logger.level
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            trainer = _SlowData(parse_args(args))
            trainer.slow = slow
            trainer.fit()
    finally:
        logger.removeHandler(collect)
        logger.setLevel(level)
    return {"stdout": stdout.getvalue(), "messages": collect.messages, "resumed_at": trainer.resumed_at}


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def observed_run(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("observed")
    common = [
        "--data", data_dir, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "4",
        "--log-interval", "1", "--save-dir", str(root / "ck"), "--save-interval-updates", "2", "--device", "cpu",
        "--max-valid-steps", "1", "--log-format", "json",
        "--tensorboard-logdir", str(root / "tb"), "--wandb-project", "distlm-test", "--wandb-run-name", "observed",
        "--mlflow-tracking-uri", f"file:{root / 'mlruns'}", "--log-file", str(root / "train.log"),
        "--profile-steps", "2:3", "--lr", "1e-9", "--lr-scheduler", "fixed", "--warmup-updates", "0",
    ]
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}
    first = run_distributed(observed_fit, 2, common + ["--max-update", "4"], True, env=env, timeout=240)
    # Resumed from update 2 as a run killed after that checkpoint would be: updates 3 and 4 come again.
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        second = [observed_fit(common + ["--max-update", "6", "--restore-file", "checkpoint_2"], False)]
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    return {"root": root, "first": first, "second": second}


def last_train_lines(lines: list[dict]) -> dict[int, dict]:
    """The train line of each update, the resumed run's where an update was done twice."""
    return {line["update"]: line for line in lines if line["kind"] == "train"}


def test_log_file_holds_the_stdout_and_log_lines_of_both_runs(observed_run):
    """As fairseq's log file: the records and rank 0's log lines, the start-up lines included."""
    root = observed_run["root"]
    assert observed_run["second"][0]["resumed_at"] == 2
    stdout = observed_run["first"][0]["stdout"] + observed_run["second"][0]["stdout"]
    expected = [line for line in stdout.splitlines() if line.startswith("{")]
    lines = (root / "train.log").read_text().splitlines()
    assert [line for line in lines if line.startswith("{")] == expected
    logged = []  # [time, level, logger, message] of each log line; a message may go on over lines
    for line in lines:
        if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \| ", line):
            logged.append(line.split(" | ", 3))
        elif not line.startswith("{"):
            logged[-1][-1] += "\n" + line
    assert all(len(parts) == 4 and parts[2] == "distlm" for parts in logged), logged
    messages = observed_run["first"][0]["messages"] + observed_run["second"][0]["messages"]
    assert [f"{level} {message}" for _, level, _, message in logged] == messages
    assert messages[0].startswith("INFO launcher ") and any(m.startswith("INFO model: ") for m in messages)
    # Each run's start-up lines come before its first record.
    first_record = lines.index(expected[0])
    assert any(line.endswith("starting from seed 1") for line in lines[:first_record])
    from distlm.observe.observer import LogFile

    assert not any(isinstance(h, LogFile) for h in logging.getLogger("distlm").handlers)  # the run's end took it off
    assert observed_run["first"][1]["stdout"] == ""  # rank 1 prints nothing
    report = [m for m in observed_run["second"][0]["messages"] if "distlm.report" in m]
    assert report == [f"INFO pictures of this run: python -m distlm.report {root / 'train.log'} --out {root / 'report'}"]
    # The resume onto one rank says so in words, not Python dicts.
    assert ("INFO layout changed (world 2, dp 2 x tp 1 -> world 1, dp 1 x tp 1): dropout RNG reseeded by "
            "data-parallel rank") in observed_run["second"][0]["messages"]


def test_numbers_in_log_lines_keep_their_significant_digits(observed_run):
    lines = json_lines((observed_run["root"] / "train.log").read_text())
    assert {line["lr"] for line in lines if line["kind"] == "train"} == {1e-09}
    # An MFU, gradient norm or rate far below 1 keeps its digits; rounding to decimals made them 0.0.
    from distlm.training.stats import TrainStats

    stats = TrainStats(flops_per_token=1.0, peak_flops_per_device=1e30)
    stats.add(torch.tensor(3.0), 4, 4, 1)
    mfu = stats.reduce(None)["mfu"]
    assert 0 < mfu < 1e-5 and mfu == float(f"{mfu:.5g}")


def test_simple_format_is_key_value_pairs_with_no_python_reprs(observed_run):
    from distlm.observe.printer import Printer

    lines = json_lines((observed_run["root"] / "train.log").read_text())
    summary = next(line for line in lines if line["kind"] == "summary")
    summary["mfu"] = None  # unknown on some devices: null, as in the JSON line
    text = Printer("simple", None, False).line({k: v for k, v in summary.items() if k != "kind"}, "summary")
    assert not set("{}[]'\"") & set(text), text
    kind, *pairs = text.split(" | ")
    fields = dict(pair.split(" ", 1) for pair in pairs)
    assert kind == "summary" and fields["mfu"] == "null" and fields["lr"] == "1e-09"
    assert fields["memory_bytes_per_rank.1.total_bytes"] == str(summary["memory_bytes_per_rank"][1]["total_bytes"])


def test_tensorboard_events_equal_the_json_lines_with_no_repeated_update(observed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = observed_run["root"]
    lines = json_lines((root / "train.log").read_text())
    accumulator = EventAccumulator(str(root / "tb"))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    expected = last_train_lines(lines)
    for key in ("loss", "ppl", "wps", "lr", "gnorm", "mfu", "slowest_rank", "step_time_max_over_median"):
        events = accumulator.Scalars(f"train/{key}")
        # The first run's 3 and 4 were purged, then logged once by the resumed run, which ran
        # on one rank: no straggler fields from it.
        steps = [1, 2] if key in ("slowest_rank", "step_time_max_over_median") else [1, 2, 3, 4, 5, 6]
        assert [e.step for e in events] == steps, key
        # TensorBoard keeps float32.
        assert [e.value for e in events] == [pytest.approx(expected[s][key], rel=1e-6) for s in steps], key
    valid = [line for line in lines if line["kind"] == "valid"]
    assert [line["update"] for line in valid] == [4, 6]  # the end of each run
    events = accumulator.Scalars("valid/loss")
    assert [e.step for e in events] == [6]  # the first run's update 4 was purged with its train lines
    assert events[0].value == pytest.approx(valid[-1]["loss"], rel=1e-6)
    # fairseq's names: train/KEY, and valid/KEY for the --valid-subset that the best checkpoint follows.
    numbers = {key for line in lines if line["kind"] == "train" for key, value in line.items()
               if isinstance(value, (int, float)) and key != "update"}
    assert set(tags) == {f"train/{key}" for key in numbers} | {"valid/loss", "valid/ppl", "valid/best_loss"}


def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (LevelDB log blocks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, position, part = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (kind == 0 and length == 0):
            position += left
            continue
        part += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            yield record
            part = b""


def test_wandb_offline_run_holds_config_and_metrics_and_is_resumed(observed_run):
    root = observed_run["root"]
    files = sorted((root / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    runs = []
    for file in files:
        records = list(wandb_records(file))
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        history = {}
        for record in records:
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history[items["_step"]] = items
        runs.append((run.run_id, run.display_name, config, history))
    (first_id, name, config, first), (second_id, _, _, second) = runs
    assert first_id == second_id and name == "observed"
    assert config["model"]["arch"] == "roberta_tiny" and config["logging"]["wandb_project"] == "distlm-test"
    lines = json_lines((root / "train.log").read_text())
    first_run = {line["update"]: line for line in lines[: len(json_lines(observed_run["first"][0]["stdout"]))]
                 if line["kind"] == "train"}
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4, 5, 6]
    assert [first[s]["train/loss"] for s in (1, 2, 3, 4)] == [first_run[s]["loss"] for s in (1, 2, 3, 4)]
    checkpoint_meta = json.loads((root / "ck" / "checkpoint_last" / "distlm.json").read_text())
    assert checkpoint_meta["trackers"]["wandb"] == first_id


def test_mlflow_file_store_holds_config_and_metrics_and_is_resumed(observed_run):
    from mlflow.tracking import MlflowClient

    root = observed_run["root"]
    client = MlflowClient(tracking_uri=f"file:{root / 'mlruns'}")
    runs = client.search_runs([client.get_experiment_by_name("distlm").experiment_id])
    assert len(runs) == 1  # the resumed run continued it
    run = runs[0]
    assert run.data.params["model.arch"] == "roberta_tiny" and run.data.params["data.batch_size"] == "4"
    checkpoint_meta = json.loads((root / "ck" / "checkpoint_last" / "distlm.json").read_text())
    assert checkpoint_meta["trackers"]["mlflow"] == run.info.run_id
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == [1, 2, 3, 4, 5, 6]  # none repeated
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "valid/loss")) == [4, 6]
    lines = last_train_lines(json_lines((root / "train.log").read_text()))
    assert {m.step: m.value for m in history}[6] == lines[6]["loss"]


def test_profile_window_writes_one_trace_per_rank_with_the_matmuls(observed_run):
    traces = sorted((observed_run["root"] / "ck" / "profiles").glob("*.json"))
    assert [t.name for t in traces] == ["rank0.json", "rank1.json"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        names = {event.get("name") for event in events}
        assert names & {"aten::mm", "aten::addmm"}
        # Only updates 2 and 3 were recorded (the resumed run started after the window).
        assert {n for n in names if isinstance(n, str) and n.startswith("update ")} == {"update 2", "update 3"}
    messages = observed_run["first"][0]["messages"]
    assert any("top operators by self time" in m and "aten::" in m for m in messages)


def test_slowed_rank_is_named(observed_run):
    first = json_lines(observed_run["first"][0]["stdout"])
    train = [line for line in first if line["kind"] == "train"]
    assert [line["slowest_rank"] for line in train] == [SLOW_RANK] * 4
    # The first update of any run is slow on every rank (allocations), so the slowed rank stands out from the second.
    assert all(line["step_time_max_over_median"] > 1.2 for line in train[1:])
    messages = observed_run["first"][0]["messages"]
    stragglers = [m for m in messages if "straggler" in m]
    assert len(stragglers) == 1 and stragglers[0].startswith(f"WARNING rank {SLOW_RANK} is a straggler")
    waits = [m for m in messages if "waits for data" in m]
    assert len(waits) == 1 and f"rank {SLOW_RANK}" in waits[0] and "--num-workers" in waits[0]


def test_report_draws_a_distlm_and_a_fairseq_log(observed_run, tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    legends = {}
    save = Figure.savefig

    def saving(figure, path, *args, **kwargs):
        legends[Path(path).name] = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
        return save(figure, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", saving)
    out = tmp_path / "report"
    assert main_report([str(observed_run["root"] / "train.log"), str(FAIRSEQ_LOG), "--out", str(out)]) == 0
    # Each log once and each kind once: a log named train.log read "train (distlm) train".
    runs = ["train.log (distlm)", f"{FAIRSEQ_LOG.name} (fairseq)"]
    assert legends["loss_vs_updates.png"] == legends["loss_vs_tokens.png"] == runs + ["train", "valid"]
    assert legends["tokens_per_s.png"] == legends["lr.png"] == runs
    pictures = sorted(out.glob("*.png"))
    names = {p.name for p in pictures}
    assert {"loss_vs_updates.png", "loss_vs_tokens.png", "tokens_per_s.png", "mfu.png", "lr.png", "gnorm.png"} <= names
    for picture in pictures:
        assert imread(picture).ndim == 3  # decodes to an RGB(A) image
    page = (out / "index.html").read_text()
    # The resumed run's updates 3 and 4 replace the first run's in the picture's points.
    from distlm.report import read_log

    lines = last_train_lines(json_lines((observed_run["root"] / "train.log").read_text()))
    drawn = read_log(observed_run["root"] / "train.log").train
    assert [(p["update"], p["loss"]) for p in drawn] == [(u, lines[u]["loss"]) for u in range(1, 7)]
    assert all(f'src="{p.name}"' in page for p in pictures)
    assert "fairseq" in page and "distlm" in page


def main_report(argv):
    from distlm.report import main as report_main

    return report_main(argv)


def _deep_json(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "train.log"
    path.write_text('{"kind": "train", "update": 1, "loss": 2.0}\n{"a": ' + "[" * 100_000 + "\n")
    return path, f"{path}: line 2 nests JSON more than 32 levels deep"


def _no_newlines(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "train.log"
    path.write_bytes(b"\0" * (2 << 20))  # as /dev/zero would give, in a regular file
    return path, f"{path}: line 1 is longer than 1 MiB"


def _dev_zero(tmp_path: Path) -> tuple[Path, str]:
    return Path("/dev/zero"), "/dev/zero is a character device, not a regular file"


@pytest.mark.parametrize("make", [_deep_json, _no_newlines, _dev_zero])
def test_report_refuses_a_log_that_is_not_one_in_one_line(make, tmp_path, capsys):
    """Read line by line under caps: no RecursionError from json, no file read whole into memory."""
    path, message = make(tmp_path)
    assert main_report([str(path), "--out", str(tmp_path / "report")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"distlm.report: error: {message}"), lines
    assert not (tmp_path / "report").exists()


def test_report_refuses_a_named_pipe_and_an_out_that_is_a_file(tmp_path, capsys):
    """A FIFO with no writer used to block the report forever: a subprocess, so a hang fails the test."""
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, "-m", "distlm.report", str(fifo), "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"distlm.report: error: {fifo} is a named pipe, not a regular file; give the log file itself "
        "(distlm's --log-file or fairseq's output)"], result.stderr
    target = tmp_path / "report.png"
    target.write_text("keep me")
    assert main_report([str(FAIRSEQ_LOG), "--out", str(target)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"distlm.report: error: --out {target} is a file; name a directory for the pictures and index.html"]
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("flag, module", [("--tensorboard-logdir", "tensorboard"), ("--wandb-project", "wandb"),
                                          ("--mlflow-tracking-uri", "mlflow")])
def test_missing_tracker_package_is_one_line_before_training(flag, module, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as with the package missing
    code = main(["--arch", "roberta_tiny", flag, str(tmp_path / "x"), "--save-dir", str(tmp_path / "ck")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"distlm: error: {flag} needs the {module} package: pip install 'distlm[trackers]'"]
    assert not (tmp_path / "ck").exists()  # nothing started


class _Recorder:
    name, run_id = "recorder", None

    def __init__(self, fail: bool = False):
        self.fail, self.seen = fail, []

    def log(self, tags, step):
        if self.fail:
            raise OSError("No space left on device")
        self.seen.append((step, tags))

    def close(self):
        pass


def test_failing_tracker_is_one_warning_and_the_others_go_on(caplog):
    broken, working = _Recorder(fail=True), _Recorder()
    trackers = Trackers([broken, working])
    with caplog.at_level(logging.WARNING, logger="distlm"):
        for update in (1, 2):
            trackers.log({"update": update, "loss": 2.0, "mfu": None, "subset": "x"}, "train")
    assert [r.getMessage() for r in caplog.records] == [
        "recorder failed (OSError: No space left on device); training goes on without it"]
    assert working.seen == [(1, {"train/loss": 2.0}), (2, {"train/loss": 2.0})]
    # Only an extra validation subset has its name in the tag, as fairseq's valid/loss.
    assert record_tags({"subset": "test", "update": 3, "loss": 1.5, "best_loss": 1.5}, "valid") == {
        "valid/test/loss": 1.5, "valid/test/best_loss": 1.5}
    assert record_tags({"subset": "valid", "update": 3, "loss": 1.5}, "valid") == {"valid/loss": 1.5}
    assert record_tags({"subset": "test", "loss": 1.5}, "valid", main_subset="test") == {"valid/loss": 1.5}
    # A mixture's source of the main subset, validated as valid/SOURCE.
    assert record_tags({"subset": "valid/wiki", "loss": 1.5}, "valid") == {"valid/wiki/loss": 1.5}


def test_report_reads_fairseq_train_inner_and_valid_records():
    from distlm.report import read_log

    run = read_log(FAIRSEQ_LOG)
    assert run.source == "fairseq"
    # train_inner every 5 updates; the end-of-epoch "train" record (train_* keys) is not a point.
    assert [p["update"] for p in run.train] == list(range(5, 61, 5))
    assert [(p["update"], p["subset"]) for p in run.valid] == [(20, "valid"), (40, "valid"), (60, "valid")]
    assert run.valid[-1]["loss"] == 10.44
    # Tokens seen: fairseq's words per batch times the updates of each interval.
    assert run.train[1]["tokens"] == run.train[0]["wpb"] * 5 + run.train[1]["wpb"] * 5


def test_run_json_records_software_config_launch_and_hardware(observed_run):
    record = json.loads((observed_run["root"] / "ck" / "run.json").read_text())
    assert record["config"]["optim"]["max_update"] == 6  # the resumed run's, which wrote it last
    assert record["launch"]["world_size"] == 1 and record["launch"]["resumed_at"] == 2
    assert record["launch"]["layout"] == {"dp": 1, "tp": 1}
    assert record["software"]["torch"] == torch.__version__
    assert record["hardware"]["cpu_cores"] == os.cpu_count() and record["hardware"]["device"] == "cpu"
    assert record["distlm"]["version"] is not None


def test_memory_snapshot_off_cuda_is_one_line(tmp_path, caplog):
    from distlm.observe.profiler import ProfileWindow

    with caplog.at_level(logging.INFO, logger="distlm"):
        ProfileWindow((1, 2), tmp_path, 0, "cpu", memory_snapshot=True)
    assert [r.getMessage() for r in caplog.records] == [
        "--memory-snapshot: the allocator history exists on CUDA only; none on cpu"]


@pytest.mark.parametrize("window", ["3:2", "0:1", "two:three"])
def test_bad_profile_window_is_one_line_before_training(window, tmp_path, capsys):
    code = main(["--arch", "roberta_tiny", "--profile-steps", window, "--save-dir", str(tmp_path / "ck")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"distlm: error: --profile-steps takes A:B, the first and last update to record (1 <= A <= B), got {window!r}"]
    assert not (tmp_path / "ck").exists()


def test_unwritable_log_file_is_one_line_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    log = tmp_path / "file" / "train.log"  # under a regular file: no directory can be made
    assert main(["--arch", "roberta_tiny", "--log-file", str(log), "--save-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"distlm: error: --log-file {log}: cannot append to it")
    assert not (tmp_path / "ck").exists()
