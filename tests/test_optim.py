"""The optimizer and the learning-rate schedules, against references computed here.

``Fp32StateAdamW`` is checked against torch's own single-tensor AdamW on fp32 weights,
and on fp16 weights against that same reference run in fp32. The schedules are checked
against fairseq's formulas, written out again in this file rather than taken from
``distlm.optim``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from distlm.config import OptimConfig
from distlm.optim import AdamWSettings, Fp32StateAdamW, LRSchedule, build_optimizer

FP16_TINY = torch.finfo(torch.float16).smallest_normal * 2.0**-10  # smallest subnormal, 5.96e-8

# ------------------------------------------------------------------ Fp32StateAdamW


def make_grads(shapes, steps: int, seed: int = 0, scale: float = 1.0) -> list[list[torch.Tensor]]:
    """A fixed gradient sequence, so both optimizers see exactly the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=gen) * scale for shape in shapes] for _ in range(steps)]


def run(optimizer, params, grads, lrs=None) -> None:
    for k, step_grads in enumerate(grads):
        if lrs is not None:
            for group in optimizer.param_groups:
                group["lr"] = lrs[k]
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        optimizer.step()


HYPER = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)
SHAPES = [(7, 5), (5,), (3, 2, 4)]
STEPS = 10


def test_fp32_state_adamw_matches_torch_adamw_on_fp32_params():
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = make_grads(SHAPES, STEPS)
    # A changing learning rate, as the schedule sets it: bias correction and decay must use the current one.
    lrs = [HYPER["lr"] * (k + 1) / STEPS for k in range(STEPS)]

    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    run(Fp32StateAdamW(ours, **HYPER), ours, grads, lrs)
    run(torch.optim.AdamW(ref, foreach=False, **HYPER), ref, grads, lrs)

    # Tolerance: both compute the same fp32 formula on the same gradients; they differ only in
    # rounding (torch divides sqrt(v) by sqrt(1 - beta2^t), this divides v by 1 - beta2^t before
    # the sqrt), which moves one step by a few ulps of the step. The gradients are fixed, so
    # nothing feeds back: after K steps the gap is at most ~K ulps of the parameter
    # (K * 2^-23 relative) plus K ulps of a step (<= lr per element). A missing or doubled weight
    # decay is lr * wd = 1e-3 relative per step, a wrong bias correction >= 1% of a step: both
    # are orders of magnitude above this bound.
    rtol = STEPS * 2.0**-23
    atol = STEPS * HYPER["lr"] * 2.0**-20
    moved = 0.0
    for a, b, start in zip(ours, ref, init):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        moved = max(moved, float((b.detach() - start).abs().max()))
    assert moved > 100 * (atol + rtol * 3)  # the comparison is not vacuous: the weights did move


def test_fp32_state_adamw_skips_params_without_grad():
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = Fp32StateAdamW([used, unused], **HYPER)
    used.grad = torch.full((3,), 0.5)
    opt.step()
    assert torch.equal(unused, torch.ones(3))  # not even weight decay touches it, as in torch.optim.AdamW
    assert unused not in opt.state
    assert not torch.equal(used, torch.ones(3))


def test_fp32_state_adamw_on_fp16_params_keeps_fp32_moments_and_no_weight_copy():
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).half()) for s in SHAPES]
    opt = Fp32StateAdamW(params, **HYPER)
    run(opt, params, make_grads(SHAPES, 3))
    for p in params:
        assert p.dtype == torch.float16
        state = opt.state[p]
        # No fp32 master weight (fairseq's plain --fp16 keeps one; this mode must not).
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == p.shape
        assert state["exp_avg_sq"].dtype == torch.float32 and state["exp_avg_sq"].shape == p.shape
        assert float(state["step"]) == 3
    fp32_state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    # Two fp32 moments per weight = 8 bytes against 2 bytes of fp16 weight (+ 4 per step counter).
    assert fp32_state_bytes == 4 * param_bytes + 4 * len(params)


def test_fp32_state_adamw_progresses_where_fp16_state_underflows():
    """Gradients of 1e-4: grad**2 = 1e-8 is below fp16's smallest subnormal (5.96e-8)."""
    shape, steps, lr = (64,), 5, 1e-3
    assert (1e-4) ** 2 < FP16_TINY
    gen = torch.Generator().manual_seed(3)
    sign = torch.sign(torch.randn(shape, generator=gen))  # a steady direction per weight
    grads = [[1e-4 * (1 + 0.5 * torch.rand(shape, generator=gen)) * sign] for _ in range(steps)]
    grads = [[g.half().float()] for (g,) in grads]  # exactly the values an fp16 gradient can hold
    hyper = dict(lr=lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    init = torch.zeros(shape)

    reference = torch.nn.Parameter(init.clone())  # fp32 weights, fp32 state: the ideal
    run(torch.optim.AdamW([reference], foreach=False, **hyper), [reference], grads)

    ours = torch.nn.Parameter(init.half())
    opt = Fp32StateAdamW([ours], **hyper)
    run(opt, [ours], grads)

    naive = torch.nn.Parameter(init.half())  # torch's AdamW keeps its moments in the weight's dtype
    naive_opt = torch.optim.AdamW([naive], foreach=False, **hyper)
    run(naive_opt, [naive], grads)

    # Adam's step is ~lr per element here, so after 5 steps |w| ~ 5e-3. fp16 holds that with
    # a relative error of 2^-11 per write; 1e-2 relative covers 5 writes with a wide margin,
    # while a step lost to underflow or blown up by it is off by 20% or more.
    assert float(reference.detach().abs().min()) > 0.5 * steps * lr
    torch.testing.assert_close(ours.float(), reference.detach(), rtol=1e-2, atol=0)
    assert float(opt.state[ours]["exp_avg_sq"].min()) > 0
    # The fp16-state optimizer's second moment is exactly zero, so its step is m / eps: garbage.
    assert torch.count_nonzero(naive_opt.state[naive]["exp_avg_sq"]) == 0
    naive_error = (naive.detach().float() - reference.detach()).abs() / reference.detach().abs()
    assert not torch.all(torch.isfinite(naive.detach().float())) or float(naive_error.min()) > 0.2


def test_fp32_state_adamw_state_dict_round_trip_keeps_fp32_moments():
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).half()) for s in SHAPES]
    opt = Fp32StateAdamW(params, **HYPER)
    grads = make_grads(SHAPES, 2, scale=1e-3)
    run(opt, params, grads[:1])
    buffer = io.BytesIO()  # through bytes, as a checkpoint file goes: no tensor shared with `opt`
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = Fp32StateAdamW(resumed_params, **HYPER)
    resumed.load_state_dict(saved)
    for p, q in zip(params, resumed_params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert resumed.state[q][key].dtype == torch.float32, key
            assert torch.equal(resumed.state[q][key], opt.state[p][key]), key
    # ... and the resumed run continues exactly as the uninterrupted one.
    run(opt, params, grads[1:])
    run(resumed, resumed_params, grads[1:])
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype, kind", [(torch.float32, torch.optim.AdamW), (torch.float16, Fp32StateAdamW)])
def test_build_optimizer_picks_by_weight_dtype_and_passes_hyperparameters(dtype, kind):
    cfg = OptimConfig(lr=3e-4, adam_betas=(0.9, 0.95), adam_eps=1e-7, weight_decay=0.05)
    frozen = torch.nn.Parameter(torch.zeros(2, dtype=dtype), requires_grad=False)
    trained = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    opt = build_optimizer([frozen, trained], AdamWSettings.from_config(cfg), dtype)
    assert type(opt) is kind
    (group,) = opt.param_groups
    assert group["params"] == [trained]  # frozen weights are not handed to the optimizer
    assert group["lr"] == 3e-4 and tuple(group["betas"]) == (0.9, 0.95)
    assert group["eps"] == 1e-7 and group["weight_decay"] == 0.05


def test_fused_adamw_on_the_cpu_equals_foreach_to_rounding(caplog):
    """build_optimizer picks torch's fused kernel for float32 CPU weights. Both kernels compute
    the same float32 update and differ only in the order and fusing of its operations, so each
    step may round each weight differently by a few ulps (4 allowed: eps 2^-23 relative, and
    of an update at most lr x (1 + weight decay) for a weight near 0); K steps add at most K
    such differences."""
    steps, shapes = 10, [(64, 33), (33,), (3, 2, 4), (1000,)]
    grads = make_grads(shapes, steps, seed=1)
    start = [torch.randn(shape, generator=torch.Generator().manual_seed(2)) for shape in shapes]
    lrs = [HYPER["lr"] * (k + 1) / steps for k in range(steps)]  # warming up, as a run does
    settings = AdamWSettings(lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                             weight_decay=HYPER["weight_decay"])
    fused = [torch.nn.Parameter(t.clone()) for t in start]
    with caplog.at_level("INFO", logger="distlm"):
        optimizer = build_optimizer(fused, settings, torch.float32)
    assert optimizer.defaults["fused"] and "AdamW, torch's fused kernel" in caplog.text
    foreach = [torch.nn.Parameter(t.clone()) for t in start]
    run(optimizer, fused, grads, lrs)
    run(torch.optim.AdamW(foreach, foreach=True, **HYPER), foreach, grads, lrs)
    ulps = steps * 4 * torch.finfo(torch.float32).eps
    for a, b in zip(fused, foreach):
        torch.testing.assert_close(a, b, rtol=ulps, atol=ulps * HYPER["lr"] * (1 + HYPER["weight_decay"]))
    assert any(not torch.equal(a, b) for a, b in zip(fused, foreach))  # two kernels did run


def test_weights_the_fused_kernel_does_not_take_get_foreach_and_the_log_says_so(caplog):
    weights = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with caplog.at_level("INFO", logger="distlm"):
        optimizer = build_optimizer(weights, AdamWSettings(lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0),
                                    torch.bfloat16)
    assert optimizer.defaults["foreach"] and not optimizer.defaults["fused"]
    assert ("AdamW, torch's foreach kernel (the fused one runs for float32 parameters on the CPU only; these are "
            "bfloat16 on cpu)") in caplog.text


# ---------------------------------------------------------------------- LRSchedule


def fairseq_polynomial(n: int, lr: float, end: float, power: float, warmup: int, total: int) -> float:
    """fairseq PolynomialDecayLRSchedule.step_update, evaluated for update n."""
    if warmup > 0 and n <= warmup:
        return lr * n / warmup
    if n >= total:
        return end
    pct_remaining = 1 - (n - warmup) / (total - warmup)
    return (lr - end) * pct_remaining**power + end


def cosine_reference(n: int, lr: float, end: float, warmup: int, total: int) -> float:
    if warmup > 0 and n <= warmup:
        return lr * n / warmup
    if n >= total:
        return end
    t = (n - warmup) / (total - warmup)
    return end + (lr - end) * (1 + math.cos(math.pi * t)) / 2


def schedule(**fields) -> LRSchedule:
    return LRSchedule(OptimConfig(**fields))


@pytest.mark.parametrize("power", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("end", [0.0, 1e-5])
def test_polynomial_decay_matches_fairseq(power, end):
    lr, warmup, total = 1e-3, 8, 50
    s = schedule(lr=lr, lr_scheduler="polynomial_decay", warmup_updates=warmup, total_num_update=total,
                 max_update=80, end_learning_rate=end, power=power)
    for n in range(1, 81):
        assert s.lr_at(n) == pytest.approx(fairseq_polynomial(n, lr, end, power, warmup, total), rel=1e-12, abs=1e-15), n
    assert s.lr_at(1) == pytest.approx(lr / warmup)
    assert s.lr_at(warmup) == pytest.approx(lr)  # the peak is reached on the last warmup update
    assert s.lr_at(total) == end and s.lr_at(80) == end  # then stays at the end rate past total


def test_polynomial_decay_total_defaults_to_max_update():
    lr, warmup, max_update = 2e-3, 4, 30
    s = schedule(lr=lr, lr_scheduler="polynomial_decay", warmup_updates=warmup, max_update=max_update, power=1.0)
    for n in range(1, max_update + 1):
        assert s.lr_at(n) == pytest.approx(fairseq_polynomial(n, lr, 0.0, 1.0, warmup, max_update), rel=1e-12, abs=1e-15)
    assert s.lr_at(max_update) == 0.0
    # Linear decay: equal drops between consecutive updates after warmup.
    drops = [s.lr_at(n) - s.lr_at(n + 1) for n in range(warmup, max_update)]
    assert drops == pytest.approx([lr / (max_update - warmup)] * len(drops), rel=1e-9)


def test_polynomial_decay_without_warmup_starts_decaying_at_once():
    s = schedule(lr=1.0, lr_scheduler="polynomial_decay", warmup_updates=0, total_num_update=10, max_update=10)
    assert [s.lr_at(n) for n in range(1, 11)] == pytest.approx([fairseq_polynomial(n, 1.0, 0.0, 1.0, 0, 10) for n in range(1, 11)])


def test_cosine_peak_after_warmup_end_at_total_monotone_between():
    lr, end, warmup, total = 1e-3, 1e-5, 5, 40
    s = schedule(lr=lr, lr_scheduler="cosine", warmup_updates=warmup, total_num_update=total, max_update=60,
                 end_learning_rate=end)
    values = [s.lr_at(n) for n in range(1, 61)]
    assert values == pytest.approx([cosine_reference(n, lr, end, warmup, total) for n in range(1, 61)], rel=1e-12)
    assert values[:warmup] == pytest.approx([lr * n / warmup for n in range(1, warmup + 1)])
    assert max(values) == pytest.approx(lr) and s.lr_at(warmup) == pytest.approx(lr)
    decay = [s.lr_at(n) for n in range(warmup, total + 1)]
    assert all(a > b for a, b in zip(decay, decay[1:]))  # strictly decreasing from peak to end
    assert s.lr_at(total) == end and s.lr_at(60) == end
    # Half way through the decay the cosine is at the midpoint of peak and end.
    assert s.lr_at(warmup + (total - warmup) // 2) == pytest.approx((lr + end) / 2, rel=0.05)


def test_fixed_is_constant_after_warmup():
    lr, warmup = 5e-4, 10
    s = schedule(lr=lr, lr_scheduler="fixed", warmup_updates=warmup, max_update=20, end_learning_rate=0.0)
    assert [s.lr_at(n) for n in range(1, warmup + 1)] == pytest.approx([lr * n / warmup for n in range(1, warmup + 1)])
    assert [s.lr_at(n) for n in range(warmup, 200)] == [lr] * (200 - warmup)  # even past max_update


def test_schedule_is_pure_and_apply_sets_every_group():
    s = schedule(lr=1e-3, lr_scheduler="polynomial_decay", warmup_updates=3, max_update=10)
    forward = [s.lr_at(n) for n in range(1, 11)]
    assert [s.lr_at(n) for n in reversed(range(1, 11))] == forward[::-1]  # no hidden state: resume-safe
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 9.0}], lr=9.0)
    assert s.apply(opt, 5) == s.lr_at(5)
    assert [g["lr"] for g in opt.param_groups] == [s.lr_at(5)] * 2
