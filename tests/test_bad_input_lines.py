"""Input that used to end in a traceback is one line naming the file or setting, exit status 2."""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from distlm import checkpoint, errors
from distlm.data.indexed_dataset import MMapIndexedDataset, write_indexed_dataset
from distlm.export.cli import main as export_main
from distlm.models.hf.io import check_config_values
from distlm.train import main
from distlm.training.trainer import Trainer

LLAMA_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("change, expected", [
    ({"vocab_size": "64"}, "vocab_size='64' must be a whole number from 1 to 16,777,216"),
    ({"hidden_size": 32.0}, "hidden_size=32.0 must be a whole number from 1 to 1,048,576"),
    ({"vocab_size": 10 ** 13}, "vocab_size=10000000000000 must be a whole number from 1 to 16,777,216"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "eight", "low_freq_factor": 1, "high_freq_factor": 4}},
     "rope_scaling.factor='eight' must be a number"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear' must be an object of rotary settings"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no' must be true or false"),
])
def test_init_from_hf_config_values_are_checked(change, expected, tmp_path, capsys):
    check_config_values(LLAMA_CONFIG, tmp_path / "config.json")  # the unchanged config passes
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **change}))
    assert main(["--init-from-hf", str(tmp_path), "--no-save", "--device", "cpu", "--tokens-per-sample", "32"]) == 2
    assert error_lines(capsys.readouterr().err) == [f"distlm: error: {tmp_path}/config.json: {expected}"]


# ------------------------------------------------------------------ checkpoints


class Payload:
    """A pickled object that only code could rebuild: refused, never run."""

    def __reduce__(self):
        return (print, ("this ran",))


def test_a_legacy_checkpoint_holding_code_is_refused_in_one_plain_line(data_dir, tmp_path, capsys):
    """torch's refusal spans lines, carries terminal escape codes and suggests weights_only=False."""
    torch.save({"format": 1, "model": Payload()}, tmp_path / "checkpoint_last.pt")
    expected = re.compile(re.escape(f"{tmp_path}/checkpoint_last.pt: not a readable distlm checkpoint (it holds a "
                                    "Python object, ") + r"\S*print" + re.escape(", that only code could rebuild; "
                                                                                  "distlm never runs it)"))
    assert main(["--data", data_dir, "--save-dir", str(tmp_path), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    lines = error_lines(err)
    assert len(lines) == 1 and expected.fullmatch(lines[0].removeprefix("distlm: error: ")), lines
    assert "\x1b" not in err and "this ran" not in out
    assert export_main(["--checkpoint", str(tmp_path / "checkpoint_last.pt"), "--out", str(tmp_path / "m")]) == 2
    out, err = capsys.readouterr()
    lines = error_lines(err)
    assert len(lines) == 1 and expected.fullmatch(lines[0].removeprefix("distlm.export: error: --checkpoint ")), lines
    assert "\x1b" not in err and "this ran" not in out


@pytest.fixture(scope="module")
def saved(data_dir, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("saved")
    assert main(["--data", data_dir, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
                 "--max-update", "1", "--save-dir", str(save_dir), "--device", "cpu",
                 "--disable-validation"]) == 0
    return save_dir


@pytest.mark.parametrize("edit, named", [
    (lambda meta: meta["progress"].update(consumed_samples=-8), "progress.consumed_samples is -8, below 0"),
    (lambda meta: meta["model_config"].update(n_experts=8), "model_config.n_experts is not a setting of distlm's"),
])
def test_a_damaged_distlm_json_is_one_line_in_resume_and_export(saved, data_dir, edit, named, tmp_path, capsys):
    save_dir = tmp_path / "save"
    shutil.copytree(saved, save_dir)
    meta_path = save_dir / checkpoint.LAST / "distlm.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["--data", data_dir, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
                 "--save-dir", str(save_dir), "--device", "cpu"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"distlm: error: {meta_path}: {named}"), lines
    assert export_main(["--checkpoint", str(save_dir), "--hf", str(tmp_path / "hf")]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"{meta_path}: {named}" in lines[0], lines


# ------------------------------------------------------------------------ data


def test_an_id_beyond_the_dictionary_late_in_the_file_is_one_line_at_load(tmp_path, capsys):
    """Found at load, before any rank or data worker could meet it in a sample."""
    rng = np.random.default_rng(0)
    (tmp_path / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(40)))  # ids 0-3 special, 4-43 words
    sentences = [np.append(rng.integers(4, 44, size=20), 2) for _ in range(300)]
    sentences[-1][5] = 44  # one id past the last symbol, in the last sentence
    write_indexed_dataset(str(tmp_path / "train"), sentences, np.uint16)
    write_indexed_dataset(str(tmp_path / "valid"), sentences[:10], np.uint16)
    assert MMapIndexedDataset(tmp_path / "train").find_id_outside(0, 44) == (44, 299)
    assert MMapIndexedDataset(tmp_path / "train").find_id_outside(0, 45) is None
    assert main(["--data", str(tmp_path), "--arch", "llama_tiny", "--tokens-per-sample", "32", "--batch-size", "2",
                 "--num-workers", "2", "--no-save", "--device", "cpu"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert lines == [f"distlm: error: data {tmp_path}/train holds token id 44 (in sequence 299) outside the "
                     "dictionary's 44 symbols; the vocabulary (dict.txt or tokenizer.json) and the .bin files do "
                     "not belong together"], lines


# ------------------------------------------------------------------ master port


@pytest.fixture
def foreign_listener():
    """A program that holds a port, accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.extend(iter(server.accept, None)), daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.mark.parametrize("launch", ["env", "fairseq"])
def test_a_master_port_held_by_another_program_is_one_line_on_rank_1(launch, foreign_listener, data_dir,
                                                                     monkeypatch, capsys):
    """Rank 0 fails at once on the busy port; rank 1 used to wait for the foreign program forever."""
    port = foreign_listener
    monkeypatch.setattr(errors, "SECOND_REPORTER_DELAY_SEC", 0.0)
    argv = ["--data", data_dir, "--no-save", "--device", "cpu", "--timeout-sec", "3"]
    if launch == "env":
        for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
            monkeypatch.setenv(name, value)
    else:
        argv += ["--distributed-world-size", "2", "--distributed-rank", "1",
                 "--distributed-init-method", f"tcp://127.0.0.1:{port}"]
    started = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - started < 60  # a hang bound: min(--timeout-sec, 60 s) and start-up
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(
        f"distlm: error: {'rank 1: ' if launch == 'env' else ''}the master address 127.0.0.1:{port} is held by a "
        "program that is not rank 0's rendezvous store (no answer in 3 s); choose a free port"), lines


# ---------------------------------------------------------------- out of memory


def overcommit_mode() -> str:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip()
    except OSError:
        return "unknown"


@pytest.mark.skipif(overcommit_mode() not in ("0", "2"), reason="needs Linux refusing allocations beyond RAM + swap")
def test_a_model_too_large_for_memory_is_one_line_with_the_need(data_dir, capsys):
    """A 4 TiB weight matrix: refused by the allocator at once (never touched), then named."""
    assert main(["--data", data_dir, "--arch", "roberta_tiny", "--encoder-embed-dim", "1048576",
                 "--encoder-ffn-embed-dim", "1048576", "--no-save", "--device", "cpu"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"distlm: error: out of memory building the model: the allocator could not get 4\.0 TiB; the model's "
        r"[\d,]+ parameters need about [\d.]+ TiB per rank for fp32 weights, gradients and Adam state under "
        r"--strategy ddp \(dp 1 x tp 1\); use a smaller model, or shard it over more ranks "
        r"\(--strategy fsdp, --tp-degree\)", lines[0]), lines


def test_out_of_memory_in_the_first_update_is_one_line_with_the_remedy(data_dir, monkeypatch, capsys):
    """The allocator's error, as torch raises it, from inside the first update."""
    def allocation_fails(self, micro_batches):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(Trainer, "train_step", allocation_fails)
    assert main(["--data", data_dir, "--arch", "roberta_tiny", "--tokens-per-sample", "32", "--batch-size", "4",
                 "--no-save", "--device", "cpu"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"distlm: error: out of memory in update 1: the allocator could not get 64\.0 GiB; the model's [\d,]+ "
        r"parameters need about [\d.]+ MiB per rank for fp32 weights, gradients and Adam state under --strategy "
        r"ddp \(dp 1 x tp 1\), plus the activations of --batch-size 4 x --tokens-per-sample 32 tokens; lower "
        r"--batch-size \(and raise --update-freq to keep the global batch\), add --activation-checkpointing, or "
        r"shard the model \(--strategy fsdp\)", lines[0]), lines
