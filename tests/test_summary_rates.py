"""What the summary line's rates describe: one window for wps, ups, tokens per device and MFU
(steady state, after the first logged interval), and MFU's FLOPs those of the whole model
under pipeline parallelism too."""

from __future__ import annotations

import pytest
import torch

from distlm.training import stats as metrics
from distlm.training.stats import TrainStats
from distlm.models import build_model
from distlm.models.flops import flops_per_token
from distlm.parallel.pipeline import cut_model


def test_the_summary_rates_leave_out_the_first_interval_and_name_their_window(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    stats = TrainStats(flops_per_token=100.0, peak_flops_per_device=1000.0, devices=2)
    assert stats.summary_rates() == {}
    # (input tokens, updates, seconds) of three logged intervals; the first compiles.
    for tokens, updates, seconds in [(10, 1, 10.0), (100, 2, 1.0), (300, 2, 1.0)]:
        for _ in range(updates):
            stats.add(torch.zeros(()), 1, tokens // updates, 1)
        clock[0] += seconds
        line = stats.reduce(None)
        stats.reset()
        if seconds == 10.0:
            assert stats.summary_rates() == {"wps": 1.0, "ups": 0.1, "tokens_per_sec_per_device": 0.5,
                                             "mfu": 0.05, "rates_over": "whole_run"}
    assert line["wps"] == 300.0  # a train line is its own interval's
    assert stats.summary_rates() == {"wps": 200.0, "ups": 2.0, "tokens_per_sec_per_device": 100.0,
                                     "mfu": pytest.approx(10.0), "rates_over": "after_first_interval"}


def test_a_pipeline_stage_counts_the_flops_of_the_whole_model():
    """MFU divides the global tokens' FLOPs by every device's peak, as without a pipeline:
    the stage left with one block must count the model's FLOPs per token, not its own."""
    whole = build_model("llama_tiny", vocab_size=64)
    expected = flops_per_token(whole, 16)
    stage = cut_model(build_model("llama_tiny", vocab_size=64), [range(0, 1)], first=True, last=False)
    assert sum(p.numel() for p in stage.parameters()) < sum(p.numel() for p in whole.parameters())
    assert flops_per_token(stage, 16) == expected


def test_with_document_masks_mfu_counts_each_documents_attention(monkeypatch):
    """Packed documents attend within themselves: MFU's attention FLOPs are those of the pairs
    the batches report (their documents' squared lengths), not the blocks' squares."""
    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    model = build_model("llama_tiny", vocab_size=64)
    seq_len = 16
    dense, peak = metrics.mfu_inputs(model, seq_len, "cuda", torch.bfloat16, document_mask=True)
    per_pair = metrics.document_attention_flops(model, True)
    assert per_pair == 12 * 4 * 192  # layers x heads x head size of llama_tiny
    assert dense == flops_per_token(model, seq_len) - per_pair * seq_len
    assert metrics.document_attention_flops(model, False) is None
    stats = TrainStats(flops_per_token=dense, peak_flops_per_device=1e6, devices=1, attention_flops_per_pair=per_pair)
    # Two rows of 16 tokens: documents of 10 and 6, then 16 tokens of one document.
    stats.add(torch.zeros(()), 30, 32, 2, 32, attention_pairs=10 ** 2 + 6 ** 2 + 16 ** 2)
    clock[0] += 2.0
    line = stats.reduce(None)
    expected = (32 * dense + (100 + 36 + 256) * per_pair) / 2.0 / 1e6
    assert line["mfu"] == pytest.approx(expected, rel=1e-4)
    # The same tokens as two whole 16-token blocks would count more attention.
    assert expected < 32 * flops_per_token(model, seq_len) / 2.0 / 1e6
