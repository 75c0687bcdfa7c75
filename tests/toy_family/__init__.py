"""A toy model family, added through the registry alone (tests/test_model_family.py): a causal
LM of per-token residual MLP blocks, with its record, torch-free config and sizes here, and its
torch parts in parts.py, as a family folder of distlm/models holds them."""

from dataclasses import dataclass

from distlm.models.family import CAUSAL_LM, FamilySizes, ModelFamily
from distlm.models.sizes import LocalParameters, ModelShape, ParameterGroups


@dataclass
class ToyConfig:
    dim: int = 32
    n_layers: int = 2
    max_positions: int = 256
    vocab_size: int = 0
    padding_idx: int = 1


def shape(config: ToyConfig) -> ModelShape:
    # No attention: one "head" of size 0 adds no attention FLOPs.
    return ModelShape(family="toy", dim=config.dim, n_layers=config.n_layers, n_heads=1, n_kv_heads=1, head_dim=0,
                      ffn_dim=config.dim, vocab_size=config.vocab_size, max_positions=config.max_positions,
                      padding_idx=config.padding_idx)


def parameter_groups(s: ModelShape) -> ParameterGroups:
    d, v = s.dim, s.vocab_size
    block = 2 * d + d * d + d  # LayerNorm, Linear with bias
    head = 2 * d + v * d  # final LayerNorm, untied output
    return ParameterGroups(embedding=v * d, per_block=block, head=head, output_projection=v * d, blocks=s.n_layers,
                           lookups=v * d, output_head=v * d)


def parameter_tensors(s: ModelShape) -> int:
    return 1 + 4 * s.n_layers + 3


def local_parameters(s: ModelShape, tp: int, ep: int = 1) -> LocalParameters:
    groups = parameter_groups(s)
    return LocalParameters(embedding=groups.embedding, per_block=groups.per_block, head=groups.head,
                           blocks=s.n_layers, matmul_embedding=0.0, matmul_head=groups.head)


FAMILY = ModelFamily(
    name="toy",
    task=CAUSAL_LM,
    config_class=ToyConfig,
    archs={"toy_tiny": ToyConfig()},
    flags={"decoder_layers": "n_layers", "decoder_embed_dim": "dim", "max_positions": "max_positions"},
    sizes=FamilySizes(shape=shape, parameter_groups=parameter_groups, parameter_tensors=parameter_tensors,
                      local_parameters=local_parameters, output_split_by_tp=False,
                      describe=lambda config: f"{config.max_positions} positions, no attention"),
    parts="toy_family.parts",
)
