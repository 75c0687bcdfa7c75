"""Hugging Face model directories on disk: ``config.json``, safetensors weights (one file,
or shards listed by ``model.safetensors.index.json``) and ``generation_config.json``.

Reading opens each weights file lazily (memory-mapped by ``safetensors.safe_open``) and
hands out one tensor per request. Writing streams: each shard's header is computed from
the tensors' names, shapes and dtypes up front, then the tensors are fetched and written
one at a time, so only one tensor is in memory however large the shard.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors import SafetensorError, safe_open

from distlm.errors import UsageError

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

# Shard files are named as transformers names them.
_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# safetensors' dtype codes.
_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


# -------------------------------------------------------------------------- JSON


def read_json(directory: str | Path, name: str) -> dict[str, Any]:
    """The JSON object in ``directory/name``; UsageError naming the file when it is missing or invalid."""
    path = Path(directory) / name
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file; is {directory} a Hugging Face model directory?") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def read_config(directory: str | Path) -> dict[str, Any]:
    """The model's ``config.json``, its sizes and numbers checked for type and range."""
    config = read_json(directory, CONFIG_NAME)
    check_config_values(config, Path(directory) / CONFIG_NAME)
    return config


# Sizes a config.json may hold, with the largest distlm accepts: far above any published
# model, far below what would ask the allocator for terabytes (a vocab_size of 10^13 did).
_SIZE_LIMITS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 20, "intermediate_size": 1 << 22, "head_dim": 1 << 16,
    "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14,
    "max_position_embeddings": 1 << 27, "original_max_position_embeddings": 1 << 27, "type_vocab_size": 1 << 10,
    "moe_intermediate_size": 1 << 22, "num_experts": 1 << 16, "num_local_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16, "decoder_sparse_step": 1 << 12, "sliding_window": 1 << 27,
}
_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "attention_dropout", "hidden_dropout_prob",
            "attention_probs_dropout_prob", "initializer_range", "factor", "low_freq_factor", "high_freq_factor",
            "partial_rotary_factor", "router_aux_loss_coef", "router_jitter_noise")
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_sliding_window")
_ROPE_KEYS = ("rope_scaling", "rope_parameters")


def check_config_values(config: dict[str, Any], path: Path) -> None:
    """Refuse, in one line, a size that is not a whole number in range, a number that is
    text, or rotary settings that are not an object: converting them fails deep in torch."""
    rope = [(f"{key}.", config[key]) for key in _ROPE_KEYS if config.get(key) is not None]
    for prefix, value in rope:
        if not isinstance(value, dict):
            raise UsageError(f"{path}: {prefix[:-1]}={value!r} must be an object of rotary settings")
    for prefix, values in [("", config)] + rope:
        for key, value in values.items():
            where = f"{path}: {prefix}{key}={value!r}"
            if key in _SIZE_LIMITS and value is not None:
                low = 0 if key == "type_vocab_size" else 1
                if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _SIZE_LIMITS[key]:
                    raise UsageError(f"{where} must be a whole number from {low} to {_SIZE_LIMITS[key]:,}")
            elif key in _NUMBERS and value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise UsageError(f"{where} must be a number")
            elif key in _FLAGS and not isinstance(value, bool):
                raise UsageError(f"{where} must be true or false")
            elif key in ("rope_type", "type") and prefix and not isinstance(value, str):
                raise UsageError(f"{where} must be the name of a rope type")


def write_json(directory: str | Path, name: str, value: dict[str, Any]) -> Path:
    """Write ``value`` as ``directory/name``, indented and key-sorted as transformers writes it."""
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    return path


# --------------------------------------------------------------------- reading


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The weights of a Hugging Face model directory, by tensor name, opened lazily.

    Reads ``model.safetensors.index.json`` (sharded) or ``model.safetensors``. Each
    ``weights[name]`` reads that one tensor from its memory-mapped file; ``read(name,
    region)`` and ``get_slice`` read part of one (e.g. a rank's rows and columns). Use as
    a context manager, or ``close()``.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._handles: dict[str, Any] = {}
        if (self.directory / WEIGHTS_INDEX_NAME).is_file():
            index = read_json(self.directory, WEIGHTS_INDEX_NAME)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise UsageError(f"{self.directory / WEIGHTS_INDEX_NAME}: has no weight_map object")
            self.weight_map: dict[str, str] = dict(weight_map)
            for filename in sorted(set(self.weight_map.values())):
                if not (self.directory / filename).is_file():
                    raise UsageError(f"{self.directory / WEIGHTS_INDEX_NAME} lists {filename}, which is missing")
        elif (self.directory / WEIGHTS_NAME).is_file():
            self.weight_map = {name: WEIGHTS_NAME for name in self._open(WEIGHTS_NAME).keys()}
        else:
            raise UsageError(
                f"{self.directory}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}; distlm reads Hugging Face "
                "safetensors weights (convert pytorch_model.bin files with transformers' save_pretrained first)"
            )

    def _open(self, filename: str) -> Any:
        if filename not in self._handles:
            path = self.directory / filename
            try:
                self._handles[filename] = safe_open(str(path), framework="pt")
            except (OSError, SafetensorError) as exc:
                raise UsageError(f"{path}: not a readable safetensors file ({exc})") from None
        return self._handles[filename]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._open(self.weight_map[name]).get_tensor(name)

    def get_slice(self, name: str) -> Any:
        """safetensors' lazy slice of tensor ``name``: ``get_shape()``, ``get_dtype()``, and
        indexing (``[rows_start:rows_end]``) that reads only the indexed part."""
        return self._open(self.weight_map[name]).get_slice(name)

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its ``region`` (a slice per dimension) read from the file."""
        return self[name] if region is None else self.get_slice(name)[region]

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)

    def __len__(self) -> int:
        return len(self.weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> SafetensorsWeights:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------- writing


def parse_size(size: int | str) -> int:
    """Bytes in ``size``, read as transformers reads ``max_shard_size``: an int is bytes;
    "5GB", "500MB", "10KB" are powers of 1000, "5GiB", "2MiB", "1KiB" of 1024, and a
    lower-case "b" ("5Gb") means bits."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise UsageError(f"max_shard_size={size} must be positive")
        return size
    match = re.fullmatch(r"(\d+)([KMG]I?B)", str(size).strip(), flags=re.IGNORECASE)
    if match is None:
        raise UsageError(f"max_shard_size={size!r} is not a size; write bytes or e.g. 5GB, 500MB, 10KB, 2GiB")
    number, unit = int(match.group(1)), match.group(2)
    power = {"K": 1, "M": 2, "G": 3}[unit[0].upper()]
    if unit.upper().endswith("IB"):
        result = number * 1024**power
    else:
        result = number * 1000**power
        if unit.endswith("b"):
            result //= 8
    if result <= 0:
        raise UsageError(f"max_shard_size={size!r} must be positive")
    return result


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name, shape and dtype, known before its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The spec of ``tensor`` (a meta tensor is enough)."""
        return cls(name, tuple(tensor.shape), tensor.dtype)


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split ``specs``, in order, into shards of at most ``max_shard_bytes`` each, as
    transformers does: a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


def write_safetensors_file(
    path: Path, specs: Sequence[TensorSpec], fetch: Callable[[str], torch.Tensor], metadata: dict[str, str]
) -> None:
    """One safetensors file: an 8-byte little-endian header length, the JSON header
    (padded with spaces to a multiple of 8, as safetensors pads it), then each tensor's
    bytes in header order, fetched and written one at a time."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in _DTYPE_CODES:
            raise ValueError(f"tensor {spec.name} has dtype {spec.dtype}, which safetensors cannot store")
        header[spec.name] = {
            "dtype": _DTYPE_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for spec in specs:
            tensor = fetch(spec.name).detach()
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"tensor {spec.name} is {tuple(tensor.shape)} {tensor.dtype}, but was announced as "
                    f"{spec.shape} {spec.dtype}"
                )
            if spec.nbytes:
                data = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
                file.write(memoryview(data.numpy()))


def write_safetensors(
    directory: str | Path,
    specs: Sequence[TensorSpec],
    fetch: Callable[[str], torch.Tensor],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
    """Write the tensors ``specs`` announce as ``model.safetensors``, or as shards of at most
    ``max_shard_size`` with ``model.safetensors.index.json``; returns the files written.

    ``fetch(name)`` is called once per tensor, in order, just before its bytes are written.
    Weights files a previous export left in ``directory`` are removed first, since readers
    that list the directory (torch's HuggingFaceStorageReader) would take them for part of
    this model.
    """
    directory = Path(directory)
    max_shard_bytes = parse_size(max_shard_size)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names repeat; each must be written once")
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.iterdir():
        if stale.name in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) or _SHARD_PATTERN.fullmatch(stale.name):
            stale.unlink()
    shards = plan_shards(specs, max_shard_bytes)
    metadata = {"format": "pt"}
    if len(shards) <= 1:
        path = directory / WEIGHTS_NAME
        write_safetensors_file(path, shards[0] if shards else [], fetch, metadata)
        return [path]
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        path = directory / _SHARD_NAME.format(index=index, count=len(shards))
        write_safetensors_file(path, shard, fetch, metadata)
        paths.append(path)
        weight_map.update((spec.name, path.name) for spec in shard)
    index_metadata = {
        "total_size": sum(spec.nbytes for spec in specs),
        "total_parameters": sum(spec.numel for spec in specs),
    }
    paths.append(write_json(directory, WEIGHTS_INDEX_NAME, {"metadata": index_metadata, "weight_map": weight_map}))
    return paths
