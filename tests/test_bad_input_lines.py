"""Input that used to end in a traceback is one line naming the file or setting, exit status 2."""

from __future__ import annotations

import json

import pytest

from distlm.models.hf.io import check_config_values
from distlm.train import main

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
