"""A pipeline stage draws the seed's initial weights holding only its own parameters.

Every pipeline rank initialises from the seed for itself; for a 70B model the whole model
on every rank of a node would not fit in host memory. ``whole_model(keep=...)`` gives the
kept parameters exactly the whole model's values while the others share one scratch
buffer, checked here for a stage of each model family.
"""

from __future__ import annotations

import pytest
import torch

from distlm.training.builder import build_model_for_run, resolve_model_spec
from distlm.config import ModelConfig
from distlm.mesh import ParallelDims

VOCAB = 97


def _seed_build(arch: str):
    spec = resolve_model_spec(ModelConfig(arch=arch))
    dims = ParallelDims(world_size=2, pp=2)
    return build_model_for_run(spec, VOCAB, 1, dims, torch.device("cpu"), torch.float32, seed=3)


@pytest.mark.parametrize("arch,stage_prefixes", [
    ("llama_tiny", ("layers.1.", "norm.", "output.")),  # the last stage
    ("roberta_tiny", ("embed_tokens.", "embed_positions.", "emb_layer_norm.", "layers.0.")),  # the first stage
])
def test_kept_parameters_equal_the_whole_models_and_the_rest_share_scratch(arch, stage_prefixes):
    build = _seed_build(arch)
    whole = dict(build.whole_model().named_parameters(remove_duplicate=False))
    keep = {name for name in whole if name.startswith(stage_prefixes)}
    assert keep and len(keep) < len(whole)
    part = build.whole_model(keep=keep)
    held = dict(part.named_parameters(remove_duplicate=False))
    for name in keep:
        assert torch.equal(held[name], whole[name]), name
    # The discarded parameters live in scratch buffers no larger than the largest of them:
    # their storage is shared, so the stage never holds the whole model.
    discarded = {held[name].untyped_storage().data_ptr() for name in whole if name not in keep
                 and held[name].data_ptr() not in {held[k].data_ptr() for k in keep}}
    assert len(discarded) == 1
    kept_bytes = sum(p.numel() * p.element_size() for name, p in held.items() if name in keep)
    largest = max(p.numel() * p.element_size() for name, p in held.items() if name not in keep)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in held.values()}
    assert sum(storages.values()) <= kept_bytes + largest
