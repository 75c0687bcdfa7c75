"""``validate(config, env, backend)``: everything that can be checked before any rendezvous.

Field-level checks (ranges, value sets) live with the fields in config.py and run when
the command line is parsed. This adds what needs the launch and the hardware: degrees
against the world size, strategy combinations, what the backend can run, and whether
the named architecture fits the layout. Every rank reaches the same verdict from the
same inputs, so bad input ends the job before any rank waits for another.
"""

from __future__ import annotations

import inspect
import logging

import torch

from distlm.backends import Backend
from distlm.backends.hardware import (
    HALF_PRECISION_CPU_FLAGS,
    cpu_half_precision_flags,
    cpu_half_precision_path,
    measure_cpu_matmul_flops,
)
from distlm.config import TrainConfig, check_settings
from distlm.errors import UsageError
from distlm.launch.cluster_env import ClusterEnv
from distlm.layout import Layout, simulated_node_of_rank
from distlm.mesh import ParallelDims
from distlm.models.contract import check_model
from distlm.models.registry import task_of
from distlm.parallel.expert import check_expert_parallel
from distlm.parallel.fsdp import check_cpu_offload
from distlm.parallel.pipeline import check_pipeline
from distlm.parallel.tp import validate_tp
from distlm.precision import MODE_DTYPES, computes_in_fp16
from distlm.training.builder import ModelSpec, resolve_model_spec

logger = logging.getLogger("distlm")

# Any vocabulary will do for shape checks: tensor parallel splits heads and feed-forward
# widths, never requires the vocabulary to divide, and the meta device allocates nothing.
_CHECK_VOCAB_SIZE = 512


def validate(
    config: TrainConfig, env: ClusterEnv, backend: Backend, model: torch.nn.Module | None = None
) -> ParallelDims:
    """UsageError for anything that cannot run; the layout's ``ParallelDims`` otherwise.

    ``model`` is the user's own model, checked against the model contract instead of
    ``--arch``.
    """
    return validate_run(config, env, backend, model)[0]


def validate_run(
    config: TrainConfig, env: ClusterEnv, backend: Backend, model: torch.nn.Module | None = None
) -> tuple[ParallelDims, ModelSpec | None, torch.nn.Module | None]:
    """``validate``, also returning the spec of ``--arch``/``--init-from-hf`` it checked and the
    meta model it checked (None for the user's own model), so that a run resolves the spec once
    and builds from that model where its vocabulary is the run's."""
    check_settings(config)
    settings = config.distributed
    dims = ParallelDims.from_layout(Layout.from_config(settings), env.world_size)
    check_strategy_options(config, dims)
    backend.check_precision(config.precision_mode)
    backend.check_strategy(settings.strategy, settings.tp_degree)
    if backend.name == "cpu" and computes_in_fp16(config.precision_mode) and not config.precision.allow_slow_fp16:
        check_cpu_fp16_speed()
    if backend.name == "cpu" and MODE_DTYPES[config.precision_mode].compute == "bf16":
        log_cpu_bf16_path()
    backend.check_network(settings.network)
    check_cpu_offload(settings.cpu_offload, backend.name)
    if model is not None:
        check_model(model)
        check_model_fits(model, config, dims)
        return dims, None, None
    return (dims, *check_arch_fits(config, dims))


# fp16 this many times slower than fp32 is refused: a run would take hours instead of minutes.
_SLOW_FP16_FACTOR = 10.0


def check_cpu_fp16_speed() -> None:
    """UsageError when fp16 matrix multiplies on this CPU are far slower than fp32 ones.

    Most CPUs have no fast fp16 arithmetic: torch falls back to a scalar loop, tens to
    hundreds of times slower than fp32, while bf16 runs at fp32 speed or faster. A short
    timed probe (a quarter of a second) finds it before a run silently takes hours. Each
    rank probes its own CPU before any process group exists; the ratio is either near 1
    (fast fp16) or tens, far from the threshold, so the ranks of one machine type agree.
    """
    # The best of many fp32 calls: a busy machine slows some calls, never speeds one up.
    fp32 = measure_cpu_matmul_flops("fp32", size=256, min_seconds=0.2)
    fp16 = measure_cpu_matmul_flops("fp16", size=256, min_seconds=0.05)
    if fp16 * _SLOW_FP16_FACTOR < fp32:
        raise UsageError(
            f"--fp16 on this CPU: an fp16 matrix multiply runs {fp32 / fp16:.0f} times slower than fp32 here "
            f"({fp16 / 1e9:.1f} against {fp32 / 1e9:.1f} GFLOP/s); use --bf16 (as fast as fp32 or faster), "
            "or --allow-slow-fp16 to run it anyway"
        )
    logger.info("--fp16 on this CPU: allowed, an fp16 matrix multiply runs at %.2fx fp32's speed here (%.1f against "
                "%.1f GFLOP/s; fp16 path: %s; CPU flags: %s)", fp16 / fp32, fp16 / 1e9, fp32 / 1e9,
                cpu_half_precision_path("fp16")[1],
                ", ".join(cpu_half_precision_flags()) or "none of " + ", ".join(HALF_PRECISION_CPU_FLAGS))


def log_cpu_bf16_path() -> None:
    """One line: whether this CPU has bf16 matrix instructions, and which, read from its flags.

    bf16 is correct on every CPU, so nothing is refused; unlike fp16 (whose slow path is
    tens of times slower or more, worth a timed probe) nothing is timed, so start-up stays
    fast. The flags decide the kernels oneDNN dispatches to, so they say what to expect.
    """
    flag, instructions = cpu_half_precision_path("bf16")
    if flag is None:
        logger.info("--bf16 on this CPU: %s: bf16 matrix multiplies go through fp32 arithmetic, no faster than fp32",
                    instructions)
    else:
        logger.info("--bf16 on this CPU: fast bf16 matrix instructions (CPU flag %s): %s", flag, instructions)


def check_strategy_options(config: TrainConfig, dims: ParallelDims) -> None:
    """Combinations no strategy can run."""
    settings, layout = config.distributed, Layout.from_config(config.distributed)
    hooks_asked = layout.hooks_asked
    if settings.strategy == "fsdp" and hooks_asked:
        raise UsageError(
            "--comm-hook/--double-buffering/--comm-transport are DDP communication hooks; "
            "FSDP reduce-scatters its own gradients: use --strategy ddp or zero1, or drop them"
        )
    if settings.cpu_offload and settings.strategy != "fsdp":
        raise UsageError("--cpu-offload is an FSDP option; add --strategy fsdp or drop it")
    if settings.cpu_offload and not dims.dp_enabled:
        raise UsageError(
            "--cpu-offload offloads FSDP's shards, and with one data-parallel rank FSDP is not applied; "
            "drop --cpu-offload or use more data-parallel ranks"
        )
    if hooks_asked and dims.tp_enabled:
        raise UsageError(
            "--comm-hook/--double-buffering/--comm-transport are DDP communication hooks, and DDP cannot hold "
            "tensor-parallel parameters; drop them or use --tp-degree 1"
        )
    if dims.ep_enabled:
        check_expert_parallel_options(config, dims)
    if settings.sequence_parallel and not dims.tp_enabled:
        raise UsageError("--sequence-parallel shards along tensor-parallel ranks; set --tp-degree > 1")
    if layout.hook.hierarchical and dims.dp_enabled and settings.ranks_per_node is not None:
        simulated_node_of_rank(settings.ranks_per_node, dims.world_size)  # refused before any rendezvous


def check_expert_parallel_options(config: TrainConfig, dims: ParallelDims) -> None:
    """What --ep-degree cannot be combined with: the dense parameters take FSDP or FSDP2's
    ``replicate`` beside the experts' DTensors (distlm/parallel/expert.py)."""
    settings = config.distributed
    if settings.strategy == "zero1":
        raise UsageError(f"--ep-degree {dims.ep} with --strategy zero1 is not offered: torch's ZeroRedundancyOptimizer "
                         "cannot hold the experts' DTensor parameters; use --strategy ddp or fsdp")
    if Layout.from_config(settings).hooks_asked:
        raise UsageError(f"--comm-hook/--double-buffering/--comm-transport are DDP communication hooks, and with "
                         f"--ep-degree {dims.ep} the dense parameters are not in torch DDP; drop them")
    if settings.cpu_offload:
        raise UsageError(f"--cpu-offload with --ep-degree {dims.ep} is not offered: FSDP would offload the dense "
                         "parameters and leave the experts on the device; drop one")


def check_model_fits(model: torch.nn.Module, config: TrainConfig, dims: ParallelDims, arch: str | None = None) -> None:
    """The model can hold the samples and split over the tensor-parallel degree (a meta model is
    enough). ``arch`` names a built-in architecture in messages; a user's model goes by its class."""
    name = f"--arch {arch}" if arch else type(model).__name__
    if config.data.tokens_per_sample > model.max_positions:
        raise UsageError(
            f"--tokens-per-sample {config.data.tokens_per_sample} exceeds {name}'s "
            f"maximum of {model.max_positions} positions; lower --tokens-per-sample"
        )
    if config.data.document_mask:
        check_document_mask(model, config, dims, name)
    check_expert_parallel(model, dims, name, dims.tp_enabled and config.distributed.sequence_parallel)
    if dims.tp_enabled:
        validate_tp(
            model, dims.tp, sequence_parallel=config.distributed.sequence_parallel,
            tokens_per_sample=config.data.tokens_per_sample, arch=arch,
        )
    if dims.pp_enabled:
        check_pipeline(model, config, dims, name)


def check_document_mask(model: torch.nn.Module, config: TrainConfig, dims: ParallelDims, name: str) -> None:
    """--document-mask needs a causal LM whose forward takes ``document_ids``."""
    task = config.data.task or getattr(model, "task", None)
    if not task_of(task).attends_causally:
        raise UsageError(f"--document-mask is for causal_lm packing; {name} trains {task}, drop --document-mask")
    if "document_ids" not in inspect.signature(model.forward).parameters:
        raise UsageError(f"--document-mask needs a model whose forward takes document_ids; {name}'s does not, "
                         "drop --document-mask")
    # Pipeline stages recompute the mask and positions from the ids they are handed.
    block_args = getattr(model, "block_args", None)
    if dims.pp_enabled and block_args is not None and "document_ids" not in inspect.signature(block_args).parameters:
        raise UsageError(f"--document-mask with --pp-degree needs {name}'s block_args to take document_ids; "
                         "drop one of them")


def check_arch_fits(config: TrainConfig, dims: ParallelDims) -> tuple[ModelSpec, torch.nn.Module]:
    """``check_model_fits`` for ``--arch`` or ``--init-from-hf``, before any data or rendezvous;
    returns the spec and the meta model it checked."""
    spec = resolve_model_spec(config.model, config.data.tokens_per_sample)
    model = spec.build(spec.config.vocab_size or _CHECK_VOCAB_SIZE, 1)
    check_model_fits(model, config, dims, arch=spec.name)
    return spec, model
