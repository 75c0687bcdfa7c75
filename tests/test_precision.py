"""Precision modes: the dynamic loss scaler, and fp16 / bf16 / memory-efficient fp16 training.

The Trainer runs in this process on a small fairseq-style data directory; every
reference (the fp32 run, the parameters before a skipped update) is computed here.
"""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from distlm.backends import hardware
from distlm.config import parse_args
from distlm.training.divergence import DivergenceError
from distlm.errors import UsageError
from distlm.optim import Fp32StateAdamW
from distlm.state.names import unwrap
from distlm.precision import DynamicLossScaler, Precision
from distlm.training import validation
from distlm.training.trainer import Trainer

# ------------------------------------------------------------------ DynamicLossScaler


def test_scaler_halves_on_overflow():
    scaler = DynamicLossScaler(init_scale=128.0, scale_window=4, min_scale=1e-4)
    scaler.update(overflow=True)
    assert scaler.scale == 64.0
    scaler.update(overflow=True)
    assert scaler.scale == 32.0


def test_scaler_doubles_after_scale_window_clean_updates():
    window = 3
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=window, min_scale=1e-4)
    seen = []
    for _ in range(2 * window):
        scaler.update(overflow=False)
        seen.append(scaler.scale)
    # Unchanged for window-1 clean updates, doubled on the window-th, again after another window.
    assert seen == [8.0] * (window - 1) + [16.0] * window + [32.0]


def test_scaler_overflow_restarts_the_clean_window():
    window = 3
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=window, min_scale=1e-4)
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    scaler.update(overflow=True)  # one short of doubling: halve and start counting again
    assert scaler.scale == 4.0
    for _ in range(window - 1):
        scaler.update(overflow=False)
        assert scaler.scale == 4.0
    scaler.update(overflow=False)
    assert scaler.scale == 8.0


def test_scaler_raises_a_clear_error_under_min_scale():
    scaler = DynamicLossScaler(init_scale=1.0, scale_window=10, min_scale=0.3)
    scaler.update(overflow=True)  # 0.5: still allowed
    assert scaler.scale == 0.5
    with pytest.raises(FloatingPointError, match=r"--min-loss-scale 0\.3") as info:
        scaler.update(overflow=True)  # 0.25 < 0.3: the run has diverged
    message = str(info.value)
    assert "loss scale" in message and "--lr" in message and "--bf16" in message  # says what to do


def test_scaler_state_dict_round_trip_resumes_the_window():
    window = 4
    original = DynamicLossScaler(init_scale=32.0, scale_window=window, min_scale=1e-4)
    for overflow in (False, True, False, False):
        original.update(overflow)
    state = original.state_dict()
    restored = DynamicLossScaler(init_scale=128.0, scale_window=window, min_scale=1e-4)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert restored.scale == original.scale == 16.0
    # Both double on the same later update: the clean-update count survived the round trip.
    for _ in range(2 * window):
        original.update(False)
        restored.update(False)
        assert restored.scale == original.scale
    assert original.scale == 64.0


def test_precision_modes():
    assert Precision.from_mode("fp32").scaler is None and Precision.from_mode("fp32").loss_scale == 1.0
    assert Precision.from_mode("bf16").scaler is None
    assert Precision.from_mode("fp16", init_scale=64.0).loss_scale == 64.0
    assert Precision.from_mode("memory_efficient_fp16").scaler is not None
    assert {m: Precision.from_mode(m).param_dtype for m in ("fp32", "bf16", "fp16", "memory_efficient_fp16")} == {
        "fp32": torch.float32, "bf16": torch.float32, "fp16": torch.float32, "memory_efficient_fp16": torch.float16,
    }
    assert Precision.from_mode("bf16").autocast_dtype == torch.bfloat16
    assert Precision.from_mode("fp16").autocast_dtype == torch.float16
    # fp16 weights need no autocast; fp32 has none.
    assert Precision.from_mode("memory_efficient_fp16").autocast_dtype is None
    assert Precision.from_mode("fp32").autocast_dtype is None


# ------------------------------------------------------------------- Trainer runs

# fp16 arithmetic is tens of times slower than fp32 on this CPU, which distlm refuses by
# default; these models are small enough that the loss-scaling logic is tested anyway.
FLAGS = {
    "fp32": [],
    "fp16": ["--fp16", "--allow-slow-fp16"],
    "bf16": ["--bf16"],
    "memory_efficient_fp16": ["--fp16", "--memory-efficient-fp16", "--allow-slow-fp16"],
}


def make_trainer(data: str, tmp_path, mode: str, arch: str = "roberta_tiny", extra: list[str] = (), save: bool = False) -> Trainer:
    args = [
        "--data", data, "--arch", arch, "--tokens-per-sample", "16", "--batch-size", "4",
        "--dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--warmup-updates", "2",
        "--max-update", "10", "--log-interval", "1000", "--log-format", "json", "--save-dir", str(tmp_path),
        "--device", "cpu", "--seed", "7", *FLAGS[mode], *extra, *([] if save else ["--no-save"]),
    ]
    return Trainer(parse_args(args))


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in unwrap(trainer.model).named_parameters()}


def record_linear_output_dtype(trainer: Trainer) -> list[torch.dtype]:
    """The dtype a Linear layer computes in during training: autocast really on, or not."""
    seen: list[torch.dtype] = []
    linear = next(m for m in unwrap(trainer.model).modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    return seen


def test_fp16_trains_with_fp32_weights_and_reports_the_loss_scale(data_dir, tmp_path, capsys):
    trainer = make_trainer(data_dir, tmp_path, "fp16", extra=["--max-update", "4", "--fp16-scale-window", "2"])
    compute_dtypes = record_linear_output_dtype(trainer)
    batches = trainer.update_batches()
    records = [trainer.train_step(next(batches)) for _ in range(4)]
    assert trainer.num_updates == 4
    assert set(compute_dtypes) == {torch.float16}  # autocast is on: matmuls run in fp16
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert type(trainer.optimizer) is torch.optim.AdamW
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    for record in records:
        assert math.isfinite(float(record["loss_sum"])) and math.isfinite(record["gnorm"])
    # Scale 128 doubles after every 2 clean updates (--fp16-scale-window 2).
    assert [r["loss_scale"] for r in records] == [128.0, 256.0, 256.0, 512.0]

    # The logged line (fit) carries loss_scale, as the README promises.
    final = make_trainer(data_dir, tmp_path, "fp16", extra=["--max-update", "2"]).fit()
    assert final["update"] == 2 and final["loss_scale"] == 128.0 and math.isfinite(final["loss"])
    assert '"loss_scale"' in capsys.readouterr().out


def test_bf16_trains_without_a_loss_scale(data_dir, tmp_path):
    trainer = make_trainer(data_dir, tmp_path, "bf16")
    compute_dtypes = record_linear_output_dtype(trainer)
    batches = trainer.update_batches()
    records = [trainer.train_step(next(batches)) for _ in range(3)]
    assert trainer.num_updates == 3
    assert set(compute_dtypes) == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert trainer.precision.scaler is None
    for record in records:
        assert "loss_scale" not in record
        assert math.isfinite(float(record["loss_sum"])) and math.isfinite(record["gnorm"])


def test_memory_efficient_fp16_keeps_fp16_weights_and_fp32_moments(data_dir, tmp_path):
    trainer = make_trainer(data_dir, tmp_path, "memory_efficient_fp16")
    compute_dtypes = record_linear_output_dtype(trainer)
    before = params_of(trainer)
    batches = trainer.update_batches()
    records = [trainer.train_step(next(batches)) for _ in range(3)]
    assert trainer.num_updates == 3
    assert set(compute_dtypes) == {torch.float16}
    params = list(trainer.model.parameters())
    assert {p.dtype for p in params} == {torch.float16}
    assert isinstance(trainer.optimizer, Fp32StateAdamW)
    assert len(trainer.optimizer.state) == len(params)
    for p in params:
        state = trainer.optimizer.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}  # no fp32 master copy of the weight
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert float(state["step"]) == 3
    for record in records:
        assert record["loss_scale"] == 128.0
        assert math.isfinite(float(record["loss_sum"])) and math.isfinite(record["gnorm"])
    after = params_of(trainer)
    assert all(torch.isfinite(t).all() for t in after.values())
    # Every weight trained, in fp16, except attention's key bias: it adds the same q.b_k to
    # every score of a query, which softmax cancels, so its gradient is exactly zero in fp16
    # (fp32 only sees rounding noise there) and Adam leaves it where it was.
    unchanged = {n for n in after if torch.equal(before[n], after[n])}
    assert all(n.endswith("k_proj.bias") for n in unchanged), unchanged
    named = dict(unwrap(trainer.model).named_parameters())
    assert all(torch.count_nonzero(trainer.optimizer.state[named[n]]["exp_avg"]) == 0 for n in unchanged)
    assert len(unchanged) < len(after) // 10


@pytest.mark.parametrize("mode", ["fp16", "memory_efficient_fp16"])
def test_overflow_skips_the_update_halves_the_scale_and_training_continues(data_dir, tmp_path, mode):
    trainer = make_trainer(data_dir, tmp_path, mode)
    batches = trainer.update_batches()
    trainer.train_step(next(batches))  # one clean update, so the optimizer has state to protect
    params_before = params_of(trainer)
    state_before = {
        name: {k: v.clone() for k, v in trainer.optimizer.state[p].items()}
        for name, p in unwrap(trainer.model).named_parameters()
    }
    consumed = trainer.consumed_samples

    real_loss_sum = trainer.compute_loss
    poisoned = []

    def loss_sum_once_infinite(batch):
        loss = real_loss_sum(batch)
        if not poisoned:
            poisoned.append(True)
            return loss * math.inf
        return loss

    trainer.compute_loss = loss_sum_once_infinite
    skipped = trainer.train_step(next(batches))
    assert poisoned
    assert not math.isfinite(skipped["gnorm"])
    assert trainer.num_updates == 1  # not advanced
    assert skipped["loss_scale"] == 64.0  # halved from 128
    assert trainer.consumed_samples > consumed  # the poisoned batch is dropped, as fairseq does
    for name, p in unwrap(trainer.model).named_parameters():
        assert torch.equal(p.detach(), params_before[name]), name
        assert p.grad is None, name  # no non-finite gradient carried into the next update
        for key, value in trainer.optimizer.state[p].items():
            assert torch.equal(value, state_before[name][key]), (name, key)

    proceeded = trainer.train_step(next(batches))
    assert trainer.num_updates == 2
    assert math.isfinite(proceeded["gnorm"]) and math.isfinite(float(proceeded["loss_sum"]))
    assert proceeded["loss_scale"] == 64.0  # stays halved until a full clean window
    # The skipped update did not consume the schedule: both used update 2's learning rate.
    assert skipped["lr"] == proceeded["lr"] == pytest.approx(trainer.schedule.lr_at(2), rel=1e-5)
    after = params_of(trainer)
    assert all(torch.isfinite(t).all() for t in after.values())
    assert any(not torch.equal(after[n], params_before[n]) for n in after)


def test_repeated_overflow_stops_with_floating_point_error(data_dir, tmp_path):
    trainer = make_trainer(data_dir, tmp_path, "fp16", extra=["--fp16-init-scale", "1", "--min-loss-scale", "0.75"])
    real_loss_sum = trainer.compute_loss
    trainer.compute_loss = lambda batch: real_loss_sum(batch) * math.inf
    with pytest.raises(FloatingPointError, match="--min-loss-scale 0.75"):
        trainer.train_step(next(trainer.update_batches()))
    assert trainer.num_updates == 0



def test_the_divergence_stop_finds_an_overflow_in_a_later_micro_batch(data_dir, tmp_path):
    """With --update-freq 2 only the second micro-batch overflows: the stop reruns the
    update's micro-batches until one names the module, instead of blaming the loss scale."""
    trainer = make_trainer(data_dir, tmp_path, "fp16", extra=["--update-freq", "2", "--fp16-max-skips", "1"])
    micro_batches = next(trainer.update_batches())
    assert len(micro_batches) == 2
    second_ids = micro_batches[1]["input_ids"]
    assert not torch.equal(micro_batches[0]["input_ids"], second_ids)
    # A Linear in the middle of the model overflows on the second micro-batch's tokens only,
    # in training and in the rerun alike.
    linears = [(name, m) for name, m in unwrap(trainer.model).named_modules() if isinstance(m, torch.nn.Linear)]
    name, poisoned = linears[len(linears) // 2]
    on_second = []
    real_loss_sum = trainer.compute_loss

    def loss_sum(batch):
        on_second[:] = [torch.equal(batch["input_ids"].cpu(), second_ids)]
        return real_loss_sum(batch)

    trainer.compute_loss = loss_sum
    poisoned.register_forward_hook(lambda module, args, output: output * math.inf if on_second[0] else None)
    with pytest.raises(DivergenceError) as stop:
        trainer.train_step(micro_batches)
    assert f"first non-finite: forward output of {name} (Linear) in micro-batch 2 of 2" in str(stop.value), stop.value
    assert trainer.num_updates == 0

def test_fp16_resume_restores_the_loss_scale(data_dir, tmp_path):
    first = make_trainer(data_dir, tmp_path, "fp16", extra=["--max-update", "3", "--fp16-scale-window", "2"], save=True)
    first.fit()
    assert first.precision.loss_scale == 256.0  # doubled once, after 2 clean updates
    resumed = make_trainer(data_dir, tmp_path, "fp16", extra=["--max-update", "4", "--fp16-scale-window", "2"], save=True)
    assert resumed.num_updates == 3
    assert resumed.precision.scaler.state_dict() == first.precision.scaler.state_dict()
    record = resumed.train_step(next(resumed.update_batches()))
    assert record["loss_scale"] == 512.0  # the 4th clean update completes the second window


def test_memory_efficient_fp16_resume_keeps_fp32_moments(data_dir, tmp_path):
    first = make_trainer(data_dir, tmp_path, "memory_efficient_fp16", extra=["--max-update", "2"], save=True)
    first.fit()
    resumed = make_trainer(data_dir, tmp_path, "memory_efficient_fp16", extra=["--max-update", "3"], save=True)
    assert resumed.num_updates == 2
    moments = [s[k] for s in resumed.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}


@pytest.mark.parametrize("flag, value", [("--fp16-scale-window", "0"), ("--fp16-init-scale", "0")])
def test_loss_scaler_settings_are_validated_up_front(flag, value):
    with pytest.raises(UsageError, match=flag):
        parse_args(["--fp16", flag, value])


# ------------------------------------------------------- reduced precision tracks fp32

TRACK_UPDATES = 10
ARCHS = ("roberta_tiny", "llama_tiny")


def trajectory(data: str, tmp_path, mode: str, arch: str, extra: list[str] = ()) -> tuple[list[float], list[float]]:
    """Per-update mean loss (nats per target token) and global gradient norm (unclipped)."""
    trainer = make_trainer(data, tmp_path, mode, arch, extra=["--clip-norm", "0", *extra])
    batches = trainer.update_batches()
    losses, gnorms = [], []
    for _ in range(TRACK_UPDATES):
        record = trainer.train_step(next(batches))
        losses.append(float(record["loss_sum"]) / record["target_tokens"])
        gnorms.append(record["gnorm"])
    assert trainer.num_updates == TRACK_UPDATES  # no update was skipped for overflow
    return losses, gnorms


# Tolerances: (loss, absolute in nats per token; gradient norm, relative), per update.
# With dropout 0 and the same seed every run sees the same batches from the same initial
# weights; the runs differ only in rounding. Autocast rounds matmul inputs to bf16 (8
# significant bits, unit roundoff u = 2^-8 ~ 4e-3) or fp16 (11 bits, u = 2^-11 ~ 5e-4),
# accumulates in fp32, and the loss itself is taken in fp32 from the logits. At ~3.9 nats
# the first update's loss therefore agrees to ~1e-3 (bf16) / ~1e-4 (fp16). Each Adam step
# moves a weight by at most ~lr = 1e-3 whatever the rounding of its gradient, but training
# feeds the differences back, so over ten updates they grow (llama's gradient norm most:
# up to ~1% for bf16 and ~0.5% for fp16 in trial runs). The bounds below sit 4-5x above
# that growth. Memory-efficient fp16 also rounds every weight write to fp16 (2^-11
# relative), which Adam's ~1e-3 steps mostly survive on 0.02-sized weights.
# What they catch: an unscaled gradient is off by the loss scale (128x) in the norm; a
# broken autocast or fp16 overflow moves the loss by far more than 0.01 nats; and
# a 25% change of the learning rate in fp32 already breaks every bound
# (test_tolerances_resolve_a_learning_rate_change), so the comparison is not vacuous.
TOLERANCE = {
    "fp16": (5e-3, 2e-2),
    "memory_efficient_fp16": (5e-3, 2e-2),
    "bf16": (1.5e-2, 4e-2),
}


@pytest.fixture(scope="module")
def fp32_trajectories(data_dir, tmp_path_factory):
    return {arch: trajectory(data_dir, tmp_path_factory.mktemp("fp32"), "fp32", arch) for arch in ARCHS}


def within(run, reference, tolerance) -> bool:
    (losses, gnorms), (ref_losses, ref_gnorms), (loss_atol, gnorm_rtol) = run, reference, tolerance
    return all(abs(a - b) <= loss_atol for a, b in zip(losses, ref_losses)) and all(
        abs(a - b) <= gnorm_rtol * abs(b) for a, b in zip(gnorms, ref_gnorms)
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["fp16", "bf16", "memory_efficient_fp16"])
def test_reduced_precision_tracks_fp32(data_dir, tmp_path, fp32_trajectories, mode, arch):
    reference = fp32_trajectories[arch]
    losses, gnorms = trajectory(data_dir, tmp_path, mode, arch)
    loss_atol, gnorm_rtol = TOLERANCE[mode]
    assert all(math.isfinite(x) for x in losses + gnorms)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=0, atol=loss_atol)
    torch.testing.assert_close(torch.tensor(gnorms), torch.tensor(reference[1]), rtol=gnorm_rtol, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_tolerances_resolve_a_learning_rate_change(data_dir, tmp_path, fp32_trajectories, arch):
    reference = fp32_trajectories[arch]
    assert within(reference, reference, (0.0, 0.0))  # fp32 on CPU is deterministic
    faster = trajectory(data_dir, tmp_path, "fp32", arch, extra=["--lr", "1.25e-3"])
    for mode, tolerance in TOLERANCE.items():
        assert not within(faster, reference, tolerance), mode


# ------------------------------------------------------------- the CPU's bf16 path


@pytest.mark.parametrize("flags, expected", [
    (["amx_bf16", "avx512_bf16"], "fast bf16 matrix instructions (CPU flag amx_bf16): AMX tiles"),
    (["avx512_bf16"], "fast bf16 matrix instructions (CPU flag avx512_bf16): AVX512-BF16 dot products"),
    (["avx512_fp16"], "no bf16 matrix instructions (neither amx_bf16 nor avx512_bf16): bf16 matrix multiplies go "
                      "through fp32 arithmetic"),
])
def test_the_bf16_line_names_the_path_the_cpus_flags_give(monkeypatch, caplog, flags, expected):
    monkeypatch.setattr(hardware, "cpu_half_precision_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger="distlm"):
        validation.log_cpu_bf16_path()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("--bf16 on this CPU: ") and expected in lines[0], lines


def test_the_fp16_path_follows_amx_fp16_then_avx512_fp16():
    assert hardware.cpu_half_precision_path("fp16", ["amx_fp16", "avx512_fp16", "amx_bf16"])[0] == "amx_fp16"
    assert hardware.cpu_half_precision_path("fp16", ["avx512_fp16", "avx512_bf16"])[0] == "avx512_fp16"
    assert hardware.cpu_half_precision_path("fp16", ["amx_bf16", "avx512_bf16"]) == (
        None, "no fp16 matrix instructions (neither amx_fp16 nor avx512_fp16)")


def test_a_bf16_cpu_run_says_its_path_once_at_start_without_a_timed_probe(data_dir, tmp_path, monkeypatch, caplog):
    def no_probe(*args, **kwargs):
        raise AssertionError("--bf16 times no matrix multiply at start-up")

    monkeypatch.setattr(validation, "measure_cpu_matmul_flops", no_probe)
    with caplog.at_level(logging.INFO, logger="distlm"):
        make_trainer(data_dir, tmp_path / "bf16", "bf16")
        make_trainer(data_dir, tmp_path / "fp32", "fp32")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--bf16 on this CPU: ")]
    flag = hardware.cpu_half_precision_path("bf16")[0]  # this machine's, whichever it is
    assert len(lines) == 1 and (f"(CPU flag {flag})" if flag else "no bf16 matrix instructions") in lines[0], lines


# ------------------------------------------- bf16 attention with dropout on a CPU


class MatmulDtypes(TorchDispatchMode):
    """The dtypes the batched matrix multiplies (SDPA's math backend) run in."""

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default:
            self.seen.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def attention_with_dropout(inputs: list[torch.Tensor], grad: torch.Tensor, dtype: torch.dtype, context):
    """Output and query, key, value gradients of SDPA with dropout 0.1 in ``dtype`` under
    ``context``, in float64, and the dtypes its matrix multiplies ran in. The seed is fixed,
    and the dropout mask is drawn element by element whatever the dtype: every call drops
    the same positions."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs)
    torch.manual_seed(1)
    with MatmulDtypes() as dtypes, context:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    out.backward(grad.to(dtype))
    return [out.double(), q.grad.double(), k.grad.double(), v.grad.double()], dtypes.seen


def test_bf16_attention_with_dropout_on_a_cpu_stays_in_bf16_and_matches_float64():
    generator = torch.Generator().manual_seed(0)
    *inputs, grad = (torch.randn(2, 4, 128, 32, generator=generator, dtype=torch.float64) for _ in range(4))
    reference, _ = attention_with_dropout(inputs, grad, torch.float64, contextlib.nullcontext())
    # Without distlm's context, torch's math backend (the only one with dropout on a CPU) upcasts bf16 to fp32.
    _, upcast = attention_with_dropout(inputs, grad, torch.bfloat16, contextlib.nullcontext())
    assert upcast == {torch.float32}
    found, kept = attention_with_dropout(inputs, grad, torch.bfloat16, Precision.from_mode("bf16").autocast("cpu"))
    assert kept == {torch.bfloat16}
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()  # restored on leaving
    # The inputs round to bf16 (unit roundoff u = 2**-8 = 3.9e-3), and so do the scores, the
    # probabilities, the dropped probabilities and the output: about five roundings of relative
    # size u, 2e-2 at worst. The upcast path keeps the middle three in fp32 and lands near 1u.
    for value, expected in zip(found, reference):
        assert (value - expected).norm() <= 2e-2 * expected.norm()
