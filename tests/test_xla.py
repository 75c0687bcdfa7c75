"""``--device xla`` for real: torch-xla on its CPU device (PJRT_DEVICE=CPU), in a lane of its own.

torch-xla 2.9 needs torch 2.9, so this lane runs in a separate environment (see the
README); in the default suite torch_xla is absent and the module is skipped:

    PJRT_DEVICE=CPU python -m pytest -m xla tests/test_xla.py

What runs here: single-process training through distlm's Trainer against the same run
in eager CPU torch; the world-size-1 ``xla`` process group with distlm's DDP (and
ZeRO-1's optimizer) against plain training; validation of a long split, which must compile
one graph per batch shape, against eager CPU's loss; and the refusal of several processes on
XLA's CPU device, whose PJRT client cannot span processes (shown for real too). The eager
references run in child processes that never import torch_xla: importing it replaces
``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
if os.environ.get("PJRT_DEVICE", "CPU") != "CPU":
    pytest.skip("the xla lane compares XLA's CPU device with eager CPU; run it with PJRT_DEVICE=CPU",
                allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import distlm  # noqa: E402
from distlm.backends.xla import XlaBackend  # noqa: E402
from distlm.config import parse_args  # noqa: E402
from distlm.data.indexed_dataset import write_indexed_dataset  # noqa: E402
from distlm.launch.cluster_env import single_process_env  # noqa: E402
from distlm.launch.detect import detect_launch
from distlm.training.memory import memory_report  # noqa: E402
from distlm.models import build_model  # noqa: E402
from distlm.optim import AdamWSettings, build_optimizer  # noqa: E402
from distlm.parallel.ddp import apply_ddp  # noqa: E402
from distlm.parallel.zero1 import Zero1Optimizer  # noqa: E402
from distlm.training.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.xla

REPO_ROOT = Path(distlm.__file__).resolve().parent.parent
SUBPROCESS_TIMEOUT = 600
UPDATES = 3
VOCAB_SIZE = 64  # above the 44 symbols of the data (4 specials + 40 words)

# Tolerance. XLA's CPU device and eager CPU compute the same fp32 gradients up to
# reassociation: their relative difference measured 6e-7, as large as eager's own between
# 1 and 2 threads. Adam turns a gradient error d into an update error of up to lr * d / eps
# where a gradient is near eps, which is why the runs use --adam-eps 1e-6 (fairseq's
# RoBERTa value): llama_tiny then differed by at most 1.4e-6 after 5 updates, against
# 3.3e-4 with eps 1e-8. 2e-5 leaves a wide margin above that and stays far below one
# update's size (lr 1e-3): a lost, doubled or mis-scheduled update shows. A gradient
# scaled wrongly, which Adam hides, shows in the gradient norms, compared to 1e-5.
PARAM_ATOL = 2e-5
GNORM_RTOL = 1e-5


@pytest.fixture(scope="module")
def initial_weights(tmp_path_factory) -> str:
    """llama_tiny initialised on the host once, for every run to start from.

    Built here rather than by --arch: distlm initialises an arch on the run's device, and
    XLA's random numbers are not the CPU generator's.
    """
    torch.manual_seed(0)
    model = build_model("llama_tiny", vocab_size=VOCAB_SIZE)
    with torch.no_grad():
        model.init_weights()
    path = tmp_path_factory.mktemp("init") / "llama_tiny.pt"
    torch.save(model.state_dict(), path)
    return str(path)


def train_args(data_dir: str, save_dir: str, device: str) -> list[str]:
    return [
        "--data", data_dir, "--tokens-per-sample", "32", "--batch-size", "8", "--lr", "1e-3",
        "--warmup-updates", "2", "--max-update", "100", "--adam-eps", "1e-6", "--clip-norm", "0.5",
        "--log-interval", "1000", "--save-dir", save_dir, "--no-save", "--seed", "3", "--device", device,
    ]


# The eager reference: the same Trainer on --device cpu, in a process that never imports torch_xla.
REFERENCE = textwrap.dedent(
    """
    import json, sys
    import torch
    from distlm.config import parse_args
    from distlm.models import build_model
    from distlm.training.trainer import Trainer

    args, initial, vocab_size, updates, out = json.loads(sys.argv[1])
    model = build_model("llama_tiny", vocab_size=vocab_size)
    model.load_state_dict(torch.load(initial))
    trainer = Trainer(parse_args(args), model=model)
    batches = trainer.update_batches()
    gnorms = [trainer.train_step(next(batches))["gnorm"] for _ in range(updates)]
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    torch.save({"params": params, "gnorms": gnorms}, out)
    assert "torch_xla" not in sys.modules
    """
)


def run_eager_reference(args: list[str], initial: str, tmp_path: Path) -> dict:
    out = tmp_path / "reference.pt"
    environ = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    environ.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", REFERENCE, json.dumps([args, initial, VOCAB_SIZE, UPDATES, str(out)])],
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env=environ,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def test_single_process_training_on_xla_equals_eager_cpu(data_dir, initial_weights, tmp_path):
    reference = run_eager_reference(train_args(data_dir, str(tmp_path / "cpu"), "cpu"), initial_weights, tmp_path)

    model = build_model("llama_tiny", vocab_size=VOCAB_SIZE)
    model.load_state_dict(torch.load(initial_weights))
    trainer = Trainer(parse_args(train_args(data_dir, str(tmp_path / "xla"), "xla")), model=model)
    assert trainer.ctx.device.type == "xla"
    batches = trainer.update_batches()
    gnorms = [trainer.train_step(next(batches))["gnorm"] for _ in range(UPDATES)]
    params = {name: p.detach().cpu() for name, p in trainer.model.named_parameters()}

    # Clipping engaged (the norms are far above --clip-norm 0.5), so the XLA clip ran.
    assert min(reference["gnorms"]) > 1.0
    np.testing.assert_allclose(gnorms, reference["gnorms"], rtol=GNORM_RTOL)
    assert params.keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        torch.testing.assert_close(params[name], expected, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
    # The memory report reads XLA storages too: one per parameter (llama_tiny ties none), and
    # Adam's two moments per parameter plus its step counters.
    report = memory_report(trainer.model, trainer.optimizer)
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert report["param_bytes"] == param_bytes
    assert 2 * param_bytes <= report["optimizer_bytes"] <= 2 * param_bytes + 8 * len(params)


# --------------------------------------------------------------------- world-size-1 xla process group


@pytest.fixture(scope="module")
def xla_world_of_one():
    """The ``xla`` process group of one process, started by the backend (xla://).

    Outside torchrun, xla:// would serve a TCPStore on a fixed port (12355); its dummy
    store needs no port, and a world of one needs no barrier.
    """
    saved = {name: os.environ.get(name) for name in ("TORCH_DIST_INIT_BARRIER", "XLA_USE_DUMMY_STORE")}
    os.environ.update(TORCH_DIST_INIT_BARRIER="0", XLA_USE_DUMMY_STORE="1")
    backend, env = XlaBackend(), single_process_env()
    backend.setup(env, "fp32", "tcp")
    backend.init_process_group(env, datetime.timedelta(seconds=60))
    yield backend, backend.device(env)
    dist.destroy_process_group()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def small_llama(state: dict | None = None) -> torch.nn.Module:
    """One llama layer: XLA compiles every new graph, which takes seconds even when small."""
    model = build_model("llama_tiny", vocab_size=VOCAB_SIZE, dim=32, n_layers=1, n_heads=2, n_kv_heads=1)
    if state is None:
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights()
    else:
        model.load_state_dict(state)
    return model


def train_on_xla(backend, device, state: dict, data: list[torch.Tensor], ddp: bool, zero1: bool) -> dict:
    model = small_llama(state).to(device)
    net = apply_ddp(model, device, dist.group.WORLD, bucket_cap_mb=25.0) if ddp else model
    settings = AdamWSettings(lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    if zero1:  # what --strategy zero1 builds over more than one process
        optimizer = Zero1Optimizer(list(net.parameters()), torch.optim.AdamW, dist.group.WORLD, foreach=True,
                                   **settings.kwargs())
    else:
        optimizer = build_optimizer(net.parameters(), settings, torch.float32)
    for tokens in data:
        tokens = tokens.to(device)
        logits = net(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=backend.foreach_clip)
        backend.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        backend.mark_step()
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def test_ddp_and_zero1_over_the_xla_process_group_equal_plain_training(xla_world_of_one):
    backend, device = xla_world_of_one
    assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("xla", 1, 0)
    state = small_llama().state_dict()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randint(4, VOCAB_SIZE, (4, 33), generator=generator) for _ in range(2)]
    plain = train_on_xla(backend, device, state, data, ddp=False, zero1=False)
    for zero1 in (False, True):
        ddp = train_on_xla(backend, device, state, data, ddp=True, zero1=zero1)
        # DDP's bucket copies and its all-reduce over one process change only how XLA
        # fuses the graph: the same fp32 reassociation bound as above.
        for name, expected in plain.items():
            torch.testing.assert_close(ddp[name], expected, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
        assert any(not torch.equal(ddp[name], state[name]) for name in state if name in ddp)  # it trained


# --------------------------------------------------------------------- several processes on XLA's CPU device


def torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    environ = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
               "DISTLM_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          env=environ)


def test_two_processes_on_xla_cpu_exit_2_with_one_line(data_dir, tmp_path):
    proc = torchrun(tmp_path, "-m", "distlm.train", *train_args(data_dir, str(tmp_path), "xla"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("distlm: error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    assert "PJRT_DEVICE=CPU runs one process only, not 2" in errors[0]
    assert "exitcode  : 2" in proc.stderr  # torchrun's report of the failed rank


def test_xla_without_an_accelerator_or_pjrt_device_cpu_is_refused(data_dir, tmp_path):
    # Unset, torch-xla would fall back to its CPU device with nothing but a warning.
    environ = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    environ.update(PYTHONPATH=str(REPO_ROOT), DISTLM_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "distlm.train", *train_args(data_dir, str(tmp_path), "xla")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env=environ)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("distlm: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-4000:]
    assert "found no XLA accelerator" in errors[0] and "export PJRT_DEVICE=CPU" in errors[0]


# Why the refusal: torch-xla's CPU PJRT client is created per process without a
# coordinator, so xla:// under torchrun gives every process rank 0 of a world of 1.
JOIN = textwrap.dedent(
    """
    import datetime
    import sys
    from distlm.backends import DistributedInitError
    from distlm.backends.xla import XlaBackend
    
    env = detect_launch()
    try:
        XlaBackend().init_process_group(env, datetime.timedelta(seconds=60))
    except DistributedInitError as err:
        sys.stdout.write(f"REFUSED {err}\\n")  # one write: the two ranks share the pipe
        sys.stdout.flush()
    """
)


def test_xla_process_group_over_torchrun_on_xla_cpu_is_a_world_of_one(tmp_path):
    script = tmp_path / "join.py"
    script.write_text(JOIN)
    proc = torchrun(tmp_path, str(script))
    assert proc.returncode == 0, proc.stderr[-4000:]
    refused = sorted(line for line in proc.stdout.splitlines() if line.startswith("REFUSED"))
    assert len(refused) == 2, proc.stdout + proc.stderr[-4000:]
    for rank, line in enumerate(refused):
        assert f"rank {rank} of world size 2 (launcher torchelastic) joined the xla process group as rank 0 of 1" in line


# ------------------------------------------------------------------------------- validation

VALIDATE = textwrap.dedent(
    """
    import json, sys
    import torch
    from distlm.config import parse_args
    from distlm.models import build_model
    from distlm.training.trainer import Trainer

    args, initial, vocab_size, out = json.loads(sys.argv[1])
    model = build_model("llama_tiny", vocab_size=vocab_size)
    model.load_state_dict(torch.load(initial))
    result = Trainer(parse_args(args), model=model).validator.validate(model)[0]
    json.dump({"loss": result.loss, "target_tokens": result.target_tokens}, open(out, "w"))
    assert "torch_xla" not in sys.modules
    """
)


def test_validation_on_xla_compiles_per_batch_shape_not_per_split(data_dir, initial_weights, tmp_path):
    """A split of about 60 batches: the graphs compiled while validating its first 3 batches serve
    every later batch (a step marked per batch, one shape padded to), so validating the
    whole split compiles nothing new; without the markers it traced one graph for the split.
    Tolerance: XLA's CPU fp32 forward differs from eager's by reassociation (relative 6e-7,
    see PARAM_ATOL), and its float32 sum of 60 batch sums adds at most 60 x 6e-8; 1e-5
    relative leaves a margin above both and is far below a batch's share (1/60)."""
    from torch_xla.debug import metrics

    data = tmp_path / "data"
    data.mkdir()
    (data / "dict.txt").write_text((Path(data_dir) / "dict.txt").read_text())
    rng = np.random.default_rng(1)
    sentences = [np.append(rng.integers(4, 44, size=31), 2) for _ in range(120)]
    write_indexed_dataset(str(data / "train"), sentences[:20], np.uint16)
    write_indexed_dataset(str(data / "valid"), sentences, np.uint16)
    def args(device: str) -> list[str]:
        return train_args(str(data), str(tmp_path), device) + ["--sample-break-mode", "none", "--batch-size-valid", "2"]

    out = tmp_path / "eager.json"
    environ = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    environ.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", VALIDATE, json.dumps([args("cpu"), initial_weights, VOCAB_SIZE, str(out)])],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env=environ)
    assert proc.returncode == 0, proc.stderr[-4000:]
    eager = json.loads(out.read_text())

    model = build_model("llama_tiny", vocab_size=VOCAB_SIZE)
    model.load_state_dict(torch.load(initial_weights))
    trainer = Trainer(parse_args(args("xla")), model=model)
    validator = trainer.validator
    assert validator.sum_dtype == torch.float32 and len(validator.subsets["valid"]) >= 100  # >= 50 batches
    validator.validate(trainer.model, max_batches=3)
    compiled = metrics.metric_data("CompileTime")[0]
    result = validator.validate(trainer.model)[0]
    assert metrics.metric_data("CompileTime")[0] == compiled  # every batch, no new graph
    assert result.target_tokens == eager["target_tokens"]
    assert result.loss == pytest.approx(eager["loss"], rel=1e-5)
