"""Packed causal-LM blocks with --document-mask: a packed block trains exactly as its
documents would, each run alone, unpacked and unpadded."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from distlm.config import parse_args
from distlm.data import load_lm_data, write_indexed_dataset
from distlm.data.masking import IGNORE_INDEX
from distlm.errors import UsageError
from distlm.models.loss import ModelInputs, summed_cross_entropy
from distlm.mesh import ParallelDims
from distlm.models import arch_config
from distlm.models.llama import model as llama
from distlm.models.llama.model import LlamaCausalLM, document_cu_seqlens, document_positions_and_mask
from distlm.models.registry import build_model
from distlm.training.trainer import Trainer
from distlm.training.validation import check_model_fits

VOCAB = 40  # dict.txt words; ids 0-3 are fairseq's specials
# Documents of several lengths; a block of tokens_per_sample + 1 = 24 tokens holds the first
# three (7 + 12 + 5), so block 0 starts and ends on document boundaries.
DOCUMENT_LENGTHS = (7, 12, 5, 9, 6)
TOKENS_PER_SAMPLE = 23


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("docmask")
    rng = np.random.default_rng(0)
    (root / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(VOCAB)))
    documents = [np.append(rng.integers(4, VOCAB + 4, size=n - 1), 2) for n in DOCUMENT_LENGTHS]
    write_indexed_dataset(str(root / "train"), documents * 4, np.uint16)
    write_indexed_dataset(str(root / "valid"), documents, np.uint16)
    return root, documents


def tiny_llama():
    torch.manual_seed(0)
    model = build_model("llama_tiny", vocab_size=VOCAB + 4, padding_idx=1, n_layers=2, max_seq_len=64)
    model.init_weights()
    return model.float()


def per_token_losses(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="none").reshape(targets.shape)


def gradients(model):
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_packed_block_equals_its_documents_alone(data_dir):
    root, documents = data_dir
    data = load_lm_data(root, "valid", "causal_lm", TOKENS_PER_SAMPLE, "none", document_mask=True)
    batch = data.collate([(0, 0)])
    # The block: documents 0, 1, 2 packed; each document's first token is no target.
    assert batch["document_ids"].tolist() == [[0] * 7 + [1] * 12 + [2] * 4]
    assert int(batch["ntokens"]) == sum(n - 1 for n in DOCUMENT_LENGTHS[:3])

    model = tiny_llama()
    logits = model(batch["input_ids"], document_ids=batch["document_ids"])
    packed_losses = per_token_losses(logits, batch["targets"])[0]
    model.zero_grad()
    summed_cross_entropy(model, batch, ModelInputs.of(model, "causal_lm")).backward()
    packed_grads = gradients(model)

    model.zero_grad()
    alone_losses = []
    for document in documents[:3]:
        tokens = torch.from_numpy(document.astype(np.int64))[None]
        losses = per_token_losses(model(tokens[:, :-1]), tokens[:, 1:])[0]
        losses.sum().backward()  # gradients of the documents' summed losses accumulate
        alone_losses.append(losses)
    alone_grads = gradients(model)

    # Packed, each document's last token predicts nothing (the next one's first is no target).
    targets = batch["targets"][0]
    kept = packed_losses[targets != IGNORE_INDEX]
    expected = torch.cat(alone_losses)
    # Same arithmetic in fp32 on other shapes: matrix products and softmax sums are blocked
    # differently over 23 tokens than over 5-12, and masked-out keys add exact zeros, so
    # only rounding differs: a few ulps of values of order 1-10 (losses near ln 44 = 3.8).
    torch.testing.assert_close(kept, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(packed_losses[targets == IGNORE_INDEX] == 0)
    for name, grad in packed_grads.items():
        # Each gradient sums 20 tokens' contributions, packed in one product and alone in
        # three: rounding of a few ulps of the tensor's largest entries (up to about 6 for
        # the embedding), so the bound is relative to that largest entry.
        scale = float(alone_grads[name].abs().max())
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_without_the_mask_documents_see_each_other(data_dir):
    """The same block without document ids attends across documents: the equality above is
    the mask's doing, not a property of the data."""
    root, documents = data_dir
    data = load_lm_data(root, "valid", "causal_lm", TOKENS_PER_SAMPLE, "none")
    batch = data.collate([(0, 0)])
    assert "document_ids" not in batch
    model = tiny_llama()
    with torch.no_grad():
        second = torch.from_numpy(documents[1].astype(np.int64))[None]
        alone = per_token_losses(model(second[:, :-1]), second[:, 1:])[0]
        packed = per_token_losses(model(batch["input_ids"]), batch["targets"])[0][7:18]
    assert not torch.allclose(packed, alone, rtol=1e-3, atol=1e-3)


def test_positions_restart_and_padding_is_its_own_document():
    ids = torch.tensor([[5, 5, 5, 8, 8, -1], [3, 3, 3, 3, 3, 3]])
    positions, mask = document_positions_and_mask(ids)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert torch.equal(mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())


def test_a_document_cut_by_a_block_boundary_starts_again_and_padding_is_no_target(data_dir):
    root, _ = data_dir
    data = load_lm_data(root, "train", "causal_lm", TOKENS_PER_SAMPLE, "none", document_mask=True)
    # The train split repeats the 39 tokens of the five documents; block 1 starts at token
    # 24, inside document 3 (tokens 24-32), whose remaining 9 tokens come first.
    starts = [0, 7, 19, 24, 33]
    block = data.collate([(0, 1)])
    ids = block["document_ids"][0].tolist()
    assert ids[:9] == [3] * 9 and ids[9:15] == [4] * 6 and ids[15] == 5
    positions, _ = document_positions_and_mask(block["document_ids"])
    assert positions[0, :10].tolist() == list(range(9)) + [0]
    # Documents start at tokens 9, 15 and 22 of the block (its first token is no target
    # anyway); the inputs before them predict nothing.
    ignored = (block["targets"][0] == IGNORE_INDEX).nonzero().flatten().tolist()
    assert ignored == [8, 14, 21]
    # The last block is short: its padding is a document of its own and carries no target.
    batch = data.collate([(0, len(data) - 1), (0, 0)])
    pad = batch["document_ids"][0] == -1
    assert pad.any() and (batch["targets"][0][pad] == IGNORE_INDEX).all()
    assert (batch["input_ids"][0][pad] == data.dictionary.pad()).all()


def test_a_run_hands_the_model_its_document_ids(data_dir, monkeypatch, caplog):
    root, _ = data_dir
    seen = []
    forward = LlamaCausalLM.forward

    def recording(self, input_ids, document_ids=None):
        seen.append((self.training, document_ids))
        return forward(self, input_ids, document_ids)

    monkeypatch.setattr(LlamaCausalLM, "forward", recording)
    with caplog.at_level("INFO", logger="distlm"):
        Trainer(parse_args(["--arch", "llama_tiny", "--data", str(root), "--tokens-per-sample", str(TOKENS_PER_SAMPLE),
                            "--sample-break-mode", "none", "--document-mask", "--batch-size", "2", "--max-update", "1",
                            "--no-save", "--device", "cpu", "--decoder-layers", "1"])).fit()
    # The start-up log says how attention keeps the documents apart.
    assert any(r.getMessage().startswith("document masking: attention through SDPA") for r in caplog.records)
    # Training and validation batches both carry them.
    assert {training for training, _ in seen} == {True, False}
    assert all(ids is not None and ids.dim() == 2 for _, ids in seen)


# ------------------------------------------------ tensor (sequence) and pipeline parallel

def documents_alone(model, documents) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses of each document run alone, unpacked and unpadded (in order), and
    the gradients of their summed losses."""
    model.zero_grad()
    losses = []
    for document in documents:
        tokens = torch.from_numpy(document.astype(np.int64))[None]
        alone = per_token_losses(model(tokens[:, :-1]), tokens[:, 1:])[0]
        alone.sum().backward()
        losses.append(alone.detach())
    return torch.cat(losses), gradients(model)


def packed_pair(root) -> dict[str, torch.Tensor]:
    """Both blocks of the valid split in one batch: documents 0-2, then 3-4 and padding (23 tokens:
    odd, so sequence parallel over 2 ranks pads each row by one)."""
    data = load_lm_data(root, "valid", "causal_lm", TOKENS_PER_SAMPLE, "none", document_mask=True)
    return data.collate([(0, 0), (0, 1)])


def _parallel_job(root: str) -> dict:
    """On 2 ranks: the packed pair through tensor parallel (sequence and loss parallel) and
    through a 2-stage pipeline; each one's per-token losses and whole gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import distlm.parallel.pipeline as pipeline
    from distlm.layout import Layout, PipelineLayout
    from distlm.parallel.api import ParallelOptions, parallelize
    from distlm.parallel.tp import apply_tp, loss_context

    dist.init_process_group("gloo")
    batch = packed_pair(root)
    out: dict = {}

    model = apply_tp(tiny_llama(), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                     sequence_parallel=True, loss_parallel=True)
    with loss_context(model):
        logits = model(batch["input_ids"], document_ids=batch["document_ids"])
        losses = per_token_losses(logits, batch["targets"])
        losses.sum().backward()
    out["tp"] = {"losses": losses.full_tensor() if isinstance(losses, DTensor) else losses.detach(),
                 "grads": {name: param.grad.full_tensor() for name, param in model.named_parameters()}}

    # Pipeline: the schedule's loss is summed_token_loss; its per-token values are recorded
    # (the last two calls: a first pass also runs the loss once on uninitialised inputs).
    recorded = []
    summed = pipeline.summed_token_loss

    def recording(logits, targets):
        recorded.append(per_token_losses(logits, targets).detach())
        return summed(logits, targets)

    pipeline.summed_token_loss = recording
    options = ParallelOptions(layout=Layout(pipeline=PipelineLayout(schedule="gpipe", microbatches=2)))
    model, handle = parallelize(tiny_llama(), ParallelDims(world_size=2, pp=2), torch.device("cpu"), options)
    handle.runner.forward_backward([batch], torch.ones(()), contextlib.nullcontext)
    out["pp"] = {"losses": torch.cat(recorded[-2:]) if recorded else None,
                 "grads": {name: param.grad for name, param in model.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def parallel_runs(data_dir):
    return run_distributed(_parallel_job, 2, str(data_dir[0]), timeout=240)


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_packed_blocks_equal_their_documents_alone_under_tp_and_pp(data_dir, parallel_runs, layout):
    """Tensor parallel 2 with sequence parallel (the document ids padded with the sequence and
    the mask built whole for attention's gathered input), and a pipeline of 2 stages (the
    document ids handed from stage to stage): the packed blocks' per-token losses and
    gradients equal those of the five documents run alone on one process."""
    root, documents = data_dir
    batch = packed_pair(root)
    expected_losses, expected_grads = documents_alone(tiny_llama(), documents)
    targets = batch["targets"]
    if layout == "tp":
        losses = parallel_runs[0]["tp"]["losses"]
        torch.testing.assert_close(parallel_runs[1]["tp"]["losses"], losses, rtol=0, atol=0)
        grads = parallel_runs[0]["tp"]["grads"]
    else:
        losses = parallel_runs[1]["pp"]["losses"]  # the last stage's
        grads = {**parallel_runs[0]["pp"]["grads"], **parallel_runs[1]["pp"]["grads"]}
    assert grads.keys() == expected_grads.keys()
    # As in the one-process test: other shapes and (under TP) sums split over two ranks change
    # only the rounding, a few ulps of values of order 1-10.
    torch.testing.assert_close(losses[targets != IGNORE_INDEX], expected_losses, rtol=1e-5, atol=1e-5)
    assert torch.all(losses[targets == IGNORE_INDEX] == 0)
    for name, grad in grads.items():
        scale = float(expected_grads[name].abs().max())
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_a_pipeline_needs_block_args_that_take_document_ids():
    config = parse_args(["--arch", "llama_tiny", "--document-mask", "--sample-break-mode", "none"])
    with torch.device("meta"):
        model = build_model("llama_tiny", vocab_size=64)
    check_model_fits(model, config, ParallelDims(world_size=2, tp=2), arch="llama_tiny")
    check_model_fits(model, config, ParallelDims(world_size=2, pp=2), arch="llama_tiny")
    model.block_args = lambda input_ids: ()
    with pytest.raises(UsageError, match="block_args to take document_ids"):
        check_model_fits(model, config, ParallelDims(world_size=2, pp=2), arch="llama_tiny")


@pytest.mark.parametrize("args, words", [
    (["--arch", "llama_tiny", "--document-mask", "--sample-break-mode", "eos"], "masks nothing"),
    (["--arch", "roberta_base", "--document-mask", "--sample-break-mode", "none"], "causal_lm"),
    (["--arch", "llama_tiny", "--document-mask", "--task", "masked_lm"], "attends both ways"),
])
def test_refused_where_it_cannot_work(args, words):
    with pytest.raises(UsageError, match=words) as err:
        Trainer(parse_args([*args, "--no-save", "--device", "cpu"]))
    assert "\n" not in str(err.value) and "--document-mask" in str(err.value)


# ----------------------------------------------------- the varlen path (CUDA's), on CPU

def random_document_ids(rows: int = 3, width: int = 29, seed: int = 0) -> torch.Tensor:
    """Rows of runs of ids, some ending in padding (-1); ids repeat across rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cumsum(torch.rand(rows, width, generator=g) < 0.2, dim=1)
    ids[0, -5:] = -1
    ids[2, -1:] = -1
    return ids


def test_varlen_offsets_name_the_masks_documents():
    ids = random_document_ids()
    rows, width = ids.shape
    cu = document_cu_seqlens(ids)
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == ids.numel()
    assert torch.all(cu[1:] > cu[:-1])
    # Each flattened token's document by the offsets, back to a [B, 1, T, T] causal mask.
    segment = torch.searchsorted(cu[1:].long(), torch.arange(ids.numel()), right=True).reshape(rows, width)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    from_offsets = (segment[:, :, None] == segment[:, None, :]) & causal
    positions, mask = document_positions_and_mask(ids)
    assert torch.equal(from_offsets[:, None], mask)
    assert torch.equal(torch.arange(ids.numel()).reshape(rows, width) - cu.long()[segment], positions)


def per_document_attention(q, k, v, cu_seqlens, max_len):
    """varlen_attn's contract, as CPU can run it: causal SDPA of each document on its own."""
    assert max_len >= int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        part = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*part, is_causal=True).transpose(0, 1)
    return out


def test_the_varlen_branch_attends_as_the_mask(monkeypatch):
    """The model's varlen path (offsets instead of the mask; tokens flattened, heads repeated
    for grouped-query attention) with the kernel's contract run per document equals the
    SDPA path's logits and gradients: only the kernel itself is CUDA's."""
    monkeypatch.setattr(llama, "varlen_causal_attention", per_document_attention)
    ids = random_document_ids()
    tokens = torch.randint(4, VOCAB + 4, ids.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for path in ("sdpa", "varlen"):
        torch.manual_seed(0)
        model = build_model("llama_tiny", vocab_size=VOCAB + 4, padding_idx=1, n_layers=2, max_seq_len=64,
                            n_kv_heads=2)
        model.init_weights()
        model.document_attention = path
        logits = model(tokens, document_ids=ids)
        logits.float().square().mean().backward()
        results[path] = logits.detach(), gradients(model)
    # Per document the products run on other shapes than the masked [T, T] ones: rounding only.
    torch.testing.assert_close(results["varlen"][0], results["sdpa"][0], rtol=1e-5, atol=1e-5)
    for name, grad in results["sdpa"][1].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(results["varlen"][1][name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("device, dtype, overrides, words", [
    ("cpu", torch.bfloat16, {}, "CUDA only"),
    ("cuda", torch.float32, {}, "bf16 or fp16"),
    ("cuda", torch.bfloat16, {"attention_dropout": 0.1}, "attention dropout"),
    ("cuda", torch.bfloat16, {"dim": 72, "n_heads": 6}, "multiples of 8"),
])
def test_where_varlen_cannot_run_the_start_up_line_says_why(device, dtype, overrides, words):
    config = dataclasses.replace(arch_config("llama_tiny"), vocab_size=64, **overrides)
    reason = llama.varlen_unavailable(config, torch.device(device), dtype)
    assert reason is not None and words in reason
    with torch.device("meta"):
        model = llama.LlamaCausalLM(config)
    line = model.use_document_attention(torch.device(device), dtype)
    assert model.document_attention == "sdpa" and "SDPA" in line and "\n" not in line
    if device == "cuda":
        assert reason in line  # on CUDA the fallback names its reason


def test_a_run_counts_the_attention_pairs_of_its_documents(data_dir):
    """The update's record carries the (query, key) pairs of its documents (each one's squared
    length, padding left out), which MFU counts instead of whole blocks'."""
    root, _ = data_dir
    trainer = Trainer(parse_args(["--arch", "llama_tiny", "--data", str(root), "--tokens-per-sample",
                                  str(TOKENS_PER_SAMPLE), "--sample-break-mode", "none", "--document-mask",
                                  "--batch-size", "2", "--max-update", "1", "--no-save", "--device", "cpu",
                                  "--decoder-layers", "1", "--disable-validation"]))
    micro_batches = next(trainer.update_batches())
    expected = 0
    for batch in micro_batches:
        for row in batch["document_ids"].tolist():
            expected += sum(len(list(run)) ** 2 for doc, run in itertools.groupby(row) if doc != -1)
    assert 0 < expected < sum(b["document_ids"].numel() * b["document_ids"].shape[1] for b in micro_batches)
    assert trainer.train_step(micro_batches)["attention_pairs"] == expected
