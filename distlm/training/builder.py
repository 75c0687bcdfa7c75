"""The model a run trains: a named ``--arch``, a Hugging Face model, or the user's own; built,
and parallelised over the run's layout (``build_parallel_model``).

``resolve_model_spec`` turns the model settings into a class and config before anything
is allocated; ``build_model_for_run`` builds it for the layout. Under FSDP or tensor
parallel the model stays on the meta device until parallelism has cut it into shards:
rank 0 then initialises it once on the host and every rank receives only its own
shards (``parallel.api.materialise``); from a Hugging Face directory, every rank reads
only its own shards from the files, one tensor at a time; and when a checkpoint will
be loaded (a resume), every rank only allocates its shards, for the checkpoint to fill.
Otherwise every rank builds the whole model the same way (same seed, or the same files).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from distlm.config import ModelConfig, TrainConfig
from distlm.data.dictionary import MASK_SYMBOL
from distlm.errors import UsageError
from distlm.layout import Layout
from distlm.mesh import ParallelDims
from distlm.models import registry
from distlm.models.contract import allocate_meta_buffers
from distlm.models.family import ModelFamily
from distlm.models.flops import count_parameters
from distlm.models.hf import SpecialTokens, adapter_for_hf, io, tensor_loader
from distlm.models.loss import ModelInputs
from distlm.parallel.api import ParallelOptions, parallelize
from distlm.parallel.handle import DataParallelHandle
from distlm.runtime.context import DistContext
from distlm.state.names import single_device_name
from distlm.training.out_of_memory import BUILD_REMEDY, describe_state_need, naming_out_of_memory


@dataclass(frozen=True)
class ModelSpec:
    """What the run trains, before any tensor exists."""

    name: str
    """``--arch`` name, or ``hf_<model_type>`` for a Hugging Face model given without --arch."""
    family: ModelFamily
    config: Any
    """The model's config; ``vocab_size`` 0 means "from the data"."""
    hf_dir: Path | None = None
    hf_tokens: SpecialTokens | None = None

    @property
    def task(self) -> str:
        return self.family.task.name

    @property
    def model_class(self) -> type[nn.Module]:
        return self.family.model_class

    def build(self, vocab_size: int, padding_idx: int, reuse: nn.Module | None = None) -> nn.Module:
        """The model on the meta device with ``vocab_size`` rows (``choose_vocabulary``): ``reuse``
        itself (a meta model built earlier, e.g. to validate the layout) where it has this config."""
        # A Hugging Face model keeps its own padding id; a named arch pads with the data's.
        padding = self.config.padding_idx if self.hf_dir is not None else padding_idx
        config = dataclasses.replace(self.config, vocab_size=vocab_size, padding_idx=padding)
        if reuse is not None and getattr(reuse, "config", None) == config:
            return reuse
        with torch.device("meta"):
            return self.model_class(config)


@dataclass(frozen=True)
class Vocabulary:
    """How many rows the token embedding has, and why (the start-up log says it)."""

    size: int
    source: str


def choose_vocabulary(spec: ModelSpec, dictionary: Any, settings: ModelConfig) -> Vocabulary:
    """The vocabulary a run builds: as fairseq, the data's dictionary (dict.txt, plus
    ``<mask>`` for masked LM); the published model's own vocabulary where the weights
    (--init-from-hf) or the tokenizer (data prepared with a Hugging Face tokenizer that
    fits it) come from it; an explicit --vocab-size when at least the dictionary's size.
    Rows beyond the dictionary are never looked up, as a published tokenizer's padding
    rows are not. A dictionary larger than the vocabulary is refused in one line.
    """
    symbols = len(dictionary) if dictionary is not None else 0
    published = spec.config.vocab_size
    if spec.hf_dir is not None:
        if settings.vocab_size not in (None, published):
            raise UsageError(f"--vocab-size {settings.vocab_size} differs from the {published} rows of the weights "
                             f"in --init-from-hf {spec.hf_dir}; drop --vocab-size")
        chosen = Vocabulary(published, f"--init-from-hf {spec.hf_dir / io.CONFIG_NAME}")
    elif settings.vocab_size is not None:
        chosen = Vocabulary(settings.vocab_size, "--vocab-size")
    elif published and hasattr(dictionary, "tokenizer_dir") and symbols <= published:
        chosen = Vocabulary(published, f"{spec.name}'s published vocabulary, as the data's tokenizer "
                                       f"{dictionary.tokenizer_dir} has {symbols} ids")
    elif symbols:
        chosen = Vocabulary(symbols, _dictionary_source(dictionary))
    else:  # a user's own data object without a dictionary: only a published size can say
        chosen = Vocabulary(published, f"{spec.name}'s published vocabulary")
    if symbols > chosen.size:
        fix = ("drop --vocab-size or raise it" if chosen.source == "--vocab-size"
               else "use data tokenized for this model, or give --vocab-size")
        raise UsageError(f"the data's dictionary has {symbols} symbols but {spec.name} has a vocabulary of "
                         f"{chosen.size} ({chosen.source}); {fix}")
    multiple = settings.pad_vocab_to_multiple
    if multiple > 1 and spec.hf_dir is None and chosen.size % multiple:
        padded = -(-chosen.size // multiple) * multiple
        chosen = Vocabulary(padded, f"{chosen.source}, {chosen.size} padded to a multiple of {multiple}")
    return chosen


def _dictionary_source(dictionary: Any) -> str:
    if hasattr(dictionary, "tokenizer_dir"):
        return f"the data's tokenizer {dictionary.tokenizer_dir}"
    mask = " + <mask>" if MASK_SYMBOL in dictionary.symbols else ""
    return f"the data's dictionary (dict.txt{mask})"


def resolve_model_spec(settings: ModelConfig, tokens_per_sample: int | None = None) -> ModelSpec:
    """The model of ``--arch`` (with fairseq's size flags) or of ``--init-from-hf``.

    ``tokens_per_sample`` sizes the learned positions of fairseq's own archs when
    --max-positions is not given, as fairseq's masked LM does.
    """
    if settings.init_from_hf is None:
        family = registry.family_of_arch(settings.arch)
        overrides = registry.arch_overrides(settings)
        if settings.arch in family.positions_from_samples and settings.max_positions is None and tokens_per_sample:
            overrides[family.flags["max_positions"]] = tokens_per_sample
        return ModelSpec(settings.arch, family, _replace(family.archs[settings.arch], overrides,
                                                         f"--arch {settings.arch}"))
    directory = Path(settings.init_from_hf)
    if not (directory / io.CONFIG_NAME).is_file():
        raise UsageError(f"--init-from-hf {directory}: no {io.CONFIG_NAME} there; name a Hugging Face model directory")
    hf_config = io.read_config(directory)
    adapter = adapter_for_hf(hf_config)
    config, tokens = adapter.config_from_hf(hf_config)
    family = registry.family_of_config(config)
    overrides = family.overrides(settings, settings.arch, registry.flag_owner)
    sized = sorted(set(overrides) & set(family.size_fields))
    if sized:
        raise UsageError(
            f"--init-from-hf takes the model's sizes from {directory / io.CONFIG_NAME}; drop the flags that "
            f"set {', '.join(sized)}"
        )
    config = _replace(config, overrides, f"--init-from-hf {directory}")
    if settings.arch is not None:
        _check_arch_agrees(settings.arch, family, config, directory)
    return ModelSpec(settings.arch or f"hf_{adapter.model_type}", family, config, directory, tokens)


def _replace(config: Any, overrides: dict[str, Any], what: str) -> Any:
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise UsageError(f"{what} has no model setting {unknown[0]}")
    return dataclasses.replace(config, **overrides)


def _check_arch_agrees(arch: str, family: ModelFamily, config: Any, directory: Path) -> None:
    arch_family = registry.family_of_arch(arch)
    if arch_family is not family:
        raise UsageError(
            f"--arch {arch} is a {arch_family.name} model but --init-from-hf {directory} holds a "
            f"{family.name} model; drop --arch or make them agree"
        )
    arch_config = family.archs[arch]
    for name in family.arch_fields + ("vocab_size",):
        mine, theirs = getattr(arch_config, name, None), getattr(config, name, None)
        if name == "vocab_size" and not mine:
            continue
        if mine != theirs:
            raise UsageError(
                f"--arch {arch} has {name}={mine} but --init-from-hf {directory} has {name}={theirs}; "
                "drop --arch or make them agree"
            )


@dataclass
class ModelBuild:
    model: nn.Module
    """Initialised on the training device, or still on meta when one of the fillers below is set."""
    whole_model: Callable[..., nn.Module] | None = None
    """The seed's initialised copy on the host, to fill the shards of a meta model: whole
    (rank 0, for FSDP and tensor parallel), or ``whole_model(keep=names)`` with only those
    parameters held (each pipeline stage, for its own)."""
    fill_shards: Callable[[nn.Module], None] | None = None
    """Fills a parallelised model's freshly allocated shards in place, each rank its own."""


def build_model_for_run(
    spec: ModelSpec | None,
    vocab_size: int,
    padding_idx: int,
    dims: ParallelDims,
    device: torch.device,
    param_dtype: torch.dtype,
    seed: int,
    user_model: nn.Module | None = None,
    checked: nn.Module | None = None,
    weights_from_checkpoint: bool = False,
) -> ModelBuild:
    """The model of the run, built for the layout (see the module docstring).

    ``weights_from_checkpoint``: a resumed run, whose checkpoint then loads every
    parameter (the load refuses a checkpoint that lacks one). The model is only allocated,
    each rank its own shards, and its derived buffers computed: it is neither initialised
    from the seed, nor read from ``--init-from-hf``, nor broadcast from rank 0. ``checked``: the
    meta model validation built, which is the run's model where it has its vocabulary; the spec's
    model class is constructed at most once more, and copies of the meta model stand for it
    (rank 0's whole initialised copy, a pipeline stage's).
    """
    if user_model is not None:
        model = _initialised(user_model, device, param_dtype, seed) if _is_meta(user_model) else user_model
        return ModelBuild(model.to(device=device, dtype=param_dtype))
    model = spec.build(vocab_size, padding_idx, reuse=checked)
    sharded = (dims.strategy == "fsdp" and dims.dp_enabled) or dims.tp_enabled or dims.pp_enabled
    from_hf = spec.hf_dir is not None
    # Expert parallel splits the experts: from Hugging Face files a rank reads only its own.
    sharded = sharded or (from_hf and dims.ep_enabled)
    if not sharded:
        if weights_from_checkpoint or from_hf:
            # Cast while still on meta, so the weights are allocated once, in their own dtype.
            model = model.to(dtype=param_dtype)
            model.to_empty(device=device)
            if weights_from_checkpoint:
                _compute_buffers(model)
            else:
                _fill_shards_from_hf(model, spec)
        else:
            model = _initialised(model, device, param_dtype, seed)
        return ModelBuild(model.to(dtype=param_dtype))  # derived buffers too, as before
    if weights_from_checkpoint:
        return ModelBuild(model.to(dtype=param_dtype), fill_shards=_compute_buffers)  # still meta: no memory yet
    if from_hf:
        return ModelBuild(model.to(dtype=param_dtype),
                          fill_shards=lambda parallel: _fill_shards_from_hf(parallel, spec))
    # The whole model as built, on meta: parallelising changes ``model`` in place, and copies of
    # this are initialised where the seed's weights are drawn (in the built dtype, then cast).
    template = copy.deepcopy(model)
    model = model.to(dtype=param_dtype)

    def whole_model(keep: Collection[str] | None = None) -> nn.Module:
        if keep is None:
            return _initialised(copy.deepcopy(template), torch.device("cpu"), param_dtype, seed)
        return _initialised_keeping(copy.deepcopy(template), keep, seed)

    return ModelBuild(model, whole_model=whole_model)


def _initialised(model: nn.Module, device: torch.device, param_dtype: torch.dtype, seed: int) -> nn.Module:
    """Materialise a meta model whole on ``device`` and initialise it from the seed."""
    model.to_empty(device=device)
    torch.manual_seed(seed)  # identical initial weights on every rank, and in one process
    with torch.no_grad():
        model.init_weights()
    return model.to(dtype=param_dtype)


@torch.no_grad()
def _initialised_keeping(model: nn.Module, keep: Collection[str], seed: int) -> nn.Module:
    """A meta model initialised from the seed on the host, where only the parameters named
    in ``keep`` get memory of their own: the others are drawn into one scratch buffer per
    dtype, the size of the largest, and overwritten by the next. ``init_weights`` draws the
    same numbers in the same order either way, so the kept parameters equal the whole
    model's, while a pipeline stage of a 70B model holds its own weights and one extra
    tensor instead of the whole model on every rank. Parameters stay in their built dtype
    (the caller's copy casts); the discarded ones still alias the scratch buffers."""
    cpu = torch.device("cpu")
    named = list(model.named_parameters(remove_duplicate=False))
    kept = {id(p) for name, p in named if name in keep}  # a tied weight is kept under either name
    largest: dict[torch.dtype, int] = {}
    for _, p in named:
        if id(p) not in kept:
            largest[p.dtype] = max(largest.get(p.dtype, 0), p.numel())
    scratch = {dtype: torch.empty(size, dtype=dtype, device=cpu) for dtype, size in largest.items()}
    materialised: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in materialised:
                data = (torch.empty_like(p, device=cpu) if id(p) in kept
                        else scratch[p.dtype][:p.numel()].view(p.shape))
                materialised[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[key] = materialised[id(p)]
    allocate_meta_buffers(model, cpu)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _compute_buffers(model: nn.Module) -> None:
    """The buffers a checkpoint does not hold (they derive from the config: Llama's rotary
    tables); the parameters are left to the checkpoint. Draws nothing from the RNG."""
    model.init_buffers()


@torch.no_grad()
def _fill_shards_from_hf(model: nn.Module, spec: ModelSpec) -> None:
    """Each parameter's local shard from the Hugging Face files, one tensor at a time.

    A rank reads only the part of each tensor that its shard holds (the rows and columns
    of a DTensor's local shard; whole tensors where it holds them whole), so it never
    holds more than its own shards plus that one part. Vocabulary rows beyond the data's
    dictionary are the model's own, as published.
    """
    with io.SafetensorsWeights(spec.hf_dir) as weights:
        load = tensor_loader(spec.hf_dir, spec.config, weights)
        for name, param in model.named_parameters():
            name = single_device_name(name)
            if isinstance(param, DTensor):
                local = param.to_local()
                if local.numel():  # an uneven split can leave a rank no rows at all
                    local.copy_(load(name, _local_region(param)))
            else:
                param.copy_(load(name))
        # Saved buffers (a mixture of experts' selection bias) come from the adapter too.
        for module_name, module in model.named_modules():
            for key, buffer in module.named_buffers(recurse=False):
                if key not in module._non_persistent_buffers_set:
                    buffer.copy_(load(single_device_name(f"{module_name}.{key}" if module_name else key)))
    model.init_buffers()  # derived from the config (rotary tables), never saved


def _local_region(param: DTensor) -> tuple[slice, ...]:
    """The part of the whole tensor that this rank's shard of ``param`` holds.

    One box per rank, as torch.distributed.checkpoint also assumes when it reads a
    DTensor's shard: distlm's layouts (FSDP's row shards, tensor parallel's row or column
    shards, and FSDP's shards of those) each give every rank one contiguous block.
    """
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(param.to_local().shape):
        raise RuntimeError(f"the shard of {tuple(param.shape)} on this rank is {tuple(param.to_local().shape)}, "
                           f"not the {tuple(shape)} its placements {param.placements} give")
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def build_parallel_model(config: TrainConfig, ctx: DistContext, spec: ModelSpec | None, user_model: nn.Module | None,
                         checked: nn.Module | None, vocab_size: int, padding_idx: int, param_dtype: torch.dtype,
                         task: str, weights_from_checkpoint: bool) -> tuple[nn.Module, DataParallelHandle, ModelInputs]:
    """The run's model built (``build_model_for_run``) and parallelised over the context's layout,
    its handle, and the inputs its forward takes (read from the single-device model's signature,
    before any wrapper hides it). The allocator's error while the model is allocated becomes one
    line with the need."""
    need = (count_parameters(dataclasses.replace(spec.config, vocab_size=vocab_size)) if spec is not None
            else sum(p.numel() for p in user_model.parameters()))
    with naming_out_of_memory("building the model", lambda: describe_state_need(need, ctx.dims, config),
                              BUILD_REMEDY):
        build = build_model_for_run(spec, vocab_size, padding_idx, ctx.dims, ctx.device, param_dtype, config.seed,
                                    user_model, checked, weights_from_checkpoint=weights_from_checkpoint)
        inputs = ModelInputs.of(build.model, task)
        model, handle = parallelize(build.model, ctx.dims, ctx.device, parallel_options(config, ctx),
                                    build.whole_model, build.fill_shards)
    return model, handle, inputs


def parallel_options(config: TrainConfig, ctx: DistContext) -> ParallelOptions:
    """The command line's layout, with the precision and what the backend adds, as ``parallelize`` takes them."""
    return ParallelOptions(
        layout=Layout.from_config(config.distributed), precision=config.precision_mode,
        compile_backend=ctx.backend.compile_backend if config.compile.compile else None,
        foreach_clip=ctx.backend.foreach_clip, grouped_mm=ctx.backend.grouped_mm,
    )
