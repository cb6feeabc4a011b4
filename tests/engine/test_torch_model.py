"""The torch runner computes what the checkpoint defines: paged attention equals dense
attention, the paged model equals a dense float64 forward of the same weights, and greedy
decoding of tiny-llama reproduces vLLM 0.32.0's recorded outputs token for token."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.api import (
    EngineRequest,
    FinishReason,
    LogprobRequest,
    SamplingParams,
    SchedulerConfig,
)
from engine.core.engine_core import EngineCore
from engine.torch_runner.attention import (
    AttentionMetadata,
    PagedKvCache,
    SequenceChunk,
    paged_attention,
    sdpa_backends,
)
from engine.torch_runner.config import Architecture, ModelConfig
from engine.torch_runner.errors import CheckpointError, InvalidBatchError, KvCacheError
from engine.torch_runner.loader import check_device, load_model
from engine.torch_runner.model import rms_norm
from engine.torch_runner.native import compiler_available, load_kernels
from engine.torch_runner.runner import TorchModelRunner
from engine.torch_runner.tokenizer import load_tokenizer
from tests.engine.detok_reference import finished_text
from tests.engine.torch_reference import (
    TINY_LLAMA,
    DrivenSequence,
    dense_logits,
    drive,
    vllm_requests,
    vllm_sequences,
    write_random_qwen2,
)

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one whole sequence in float64: q [L, H, D], k/v [L, KVH, D]."""
    repeat = q.shape[1] // k.shape[1]
    q, k, v = (
        q.double(),
        k.double().repeat_interleave(repeat, 1),
        v.double().repeat_interleave(repeat, 1),
    )
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


def one_layer_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> PagedKvCache:
    return PagedKvCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.float32,
        device=CPU,
    )


@settings(max_examples=40, deadline=None)
@given(
    num_kv_heads=st.integers(1, 3),
    queries_per_kv=st.integers(1, 3),
    head_dim=st.sampled_from([8, 12, 16]),
    block_size=st.sampled_from([1, 3, 4, 16]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    chunk_sizes=st.lists(st.integers(1, 17), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
    use_kernel=st.booleans(),
    kernel_max_chunk_keys=st.sampled_from([0, 20, 1 << 15]),
    min_fresh_prefill_tokens=st.sampled_from([1, 8, 1 << 15]),
)
def test_paged_attention_equals_dense_attention(
    *,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    block_size: int,
    lengths: list[int],
    chunk_sizes: list[int],
    seed: int,
    use_kernel: bool,
    kernel_max_chunk_keys: int,
    min_fresh_prefill_tokens: int,
) -> None:
    # With the native kernel (where it builds), decodes and the prefill chunks ending within
    # `kernel_max_chunk_keys` read the blocks in place, longer chunks of the same step gather
    # (0: every prefill chunk, 1 << 15: none here); without it, every chunk gathers. Of the
    # chunks that would gather, those from position 0 of at least `min_fresh_prefill_tokens`
    # run causal SDPA on their own keys instead (1 << 15: none here).
    kernel = load_kernels() if use_kernel else None
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * queries_per_kv
    blocks_needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_needed) + 2
    # Scattered, non-contiguous block tables.
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in blocks_needed:
        tables.append(pool[:n])
        pool = pool[n:]
    qs = [torch.randn(n, num_heads, head_dim, generator=g) for n in lengths]
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in lengths]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in lengths]
    cache = one_layer_cache(num_blocks, block_size, num_kv_heads, head_dim)
    outputs = [torch.full_like(q, float("nan")) for q in qs]
    done = [0] * len(lengths)
    step = 0
    # Each step, every unfinished sequence computes a chunk (sizes cycle through chunk_sizes):
    # prefill chunks and one-token decodes mix in one batch.
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        members = [i for i, n in enumerate(lengths) if done[i] < n]
        chunks = []
        for j, i in enumerate(members):
            size = min(chunk_sizes[(step + j) % len(chunk_sizes)], lengths[i] - done[i])
            chunks.append(SequenceChunk(done[i], size, tables[i]))
        # Groups split by padding only, into one sequence each, or by gathered bytes.
        key_bytes = (None, 1 << 30, 2 * block_size * head_dim)[step % 3]
        metadata = AttentionMetadata.build(
            chunks,
            block_size=block_size,
            num_blocks=num_blocks,
            device=CPU,
            key_bytes=key_bytes,
            kernel_rows=kernel is not None,
            kernel_max_chunk_keys=kernel_max_chunk_keys,
            min_fresh_prefill_tokens=min_fresh_prefill_tokens,
        )
        sl = [slice(c.start, c.start + c.num_tokens) for c in chunks]
        # Odd steps gather into the cache's reused workspace, even ones into fresh tensors.
        workspace = cache.workspace if step % 2 else None
        if workspace is not None:
            workspace.reserve(metadata.max_group_blocks)
        out = paged_attention(
            torch.cat([qs[i][s] for i, s in zip(members, sl, strict=True)]),
            torch.cat([ks[i][s] for i, s in zip(members, sl, strict=True)]),
            torch.cat([vs[i][s] for i, s in zip(members, sl, strict=True)]),
            key_cache=cache.keys[0],
            value_cache=cache.values[0],
            metadata=metadata,
            scale=head_dim**-0.5,
            workspace=workspace,
            kernel=kernel,
        )
        offset = 0
        for i, c in zip(members, chunks, strict=True):
            outputs[i][c.start : c.start + c.num_tokens] = out[offset : offset + c.num_tokens]
            offset += c.num_tokens
            done[i] += c.num_tokens
        step += 1
    for q, k, v, out in zip(qs, ks, vs, outputs, strict=True):
        torch.testing.assert_close(out.double(), dense_attention(q, k, v), atol=2e-5, rtol=1e-5)


def fresh_prefill_step(
    lengths: list[int], *, min_fresh_prefill_tokens: int
) -> tuple[list[torch.Tensor], AttentionMetadata, PagedKvCache]:
    """One step prefilling cold prompts of `lengths` (4 KV heads, 8 query heads, block size
    16): their q/k/v [L, H or KVH, 64], the step's metadata, and an empty cache for it."""
    g = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim = 16, 4, 64
    tables, next_block = [], 0
    for n in lengths:
        tables.append(list(range(next_block, next_block + -(-n // block_size)))[::-1])
        next_block += len(tables[-1])
    chunks = [SequenceChunk(0, n, t) for n, t in zip(lengths, tables, strict=True)]
    metadata = AttentionMetadata.build(
        chunks,
        block_size=block_size,
        num_blocks=next_block,
        device=CPU,
        key_bytes=num_kv_heads * head_dim * 4,
        min_fresh_prefill_tokens=min_fresh_prefill_tokens,
    )
    total = sum(lengths)
    qkv = [torch.randn(total, h, head_dim, generator=g) for h in (8, num_kv_heads, num_kv_heads)]
    return qkv, metadata, one_layer_cache(next_block, block_size, num_kv_heads, head_dim)


def test_a_cold_prompt_attends_to_its_own_keys_without_reading_the_cache() -> None:
    """A fresh prefill (from position 0) has nothing cached before it: its attention is
    causal SDPA straight on the step's keys and values (no gather, no mask). Proof: the cache
    holds NaN, its keys are not written there (`stored`), and the output is still exact."""
    lengths = [300, 257]
    (q, k, v), metadata, cache = fresh_prefill_step(lengths, min_fresh_prefill_tokens=256)
    assert [(f.first, f.num_tokens) for f in metadata.fresh_prefills] == [(0, 300), (300, 257)]
    assert metadata.groups == ()
    cache.keys[0].fill_(float("nan"))
    cache.values[0].fill_(float("nan"))
    out = paged_attention(
        q,
        k,
        v,
        key_cache=cache.keys[0],
        value_cache=cache.values[0],
        metadata=metadata,
        scale=64**-0.5,
        stored=True,
    )
    first = slice(0, 300)
    second = slice(300, 557)
    for rows in (first, second):
        expected = dense_attention(q[rows], k[rows], v[rows])
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-5, rtol=1e-5)


def test_a_fresh_prefill_without_its_keys_and_values_is_refused() -> None:
    """The caller that wrote the step's keys itself (`stored`) may leave them out only when no
    fresh prefill reads them, and one that did not must pass them: otherwise a clear error,
    not attention over the wrong keys."""
    (q, _, _), metadata, cache = fresh_prefill_step([100], min_fresh_prefill_tokens=64)
    for stored in (True, False):
        with pytest.raises(KvCacheError, match="the step's own keys and values"):
            paged_attention(
                q,
                None,
                None,
                key_cache=cache.keys[0],
                value_cache=cache.values[0],
                metadata=metadata,
                scale=64**-0.5,
                stored=stored,
            )


def test_the_fresh_prefill_path_gives_the_gathering_path_s_outputs_and_cache() -> None:
    """The same cold prompts through the causal fast path and through the groups (gather,
    mask): the same attention output, and the same keys and values left in the cache for the
    steps after it."""
    outputs, caches = [], []
    for minimum in (1, 1 << 20):
        (q, k, v), metadata, cache = fresh_prefill_step(
            [1024, 40], min_fresh_prefill_tokens=minimum
        )
        assert bool(metadata.fresh_prefills) == (minimum == 1)
        out = paged_attention(
            q,
            k,
            v,
            key_cache=cache.keys[0],
            value_cache=cache.values[0],
            metadata=metadata,
            scale=64**-0.5,
        )
        outputs.append(out)
        caches.append((cache.keys[0], cache.values[0]))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-6)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_decodes_share_one_group_on_a_gpu_but_split_by_cache_bytes_on_cpu() -> None:
    """32 decodes of contexts 40-300 tokens: on CPU the gathered bytes split them (a core's
    cache); on any other device ("meta" stands for a GPU here: same code, no memory) they are
    one group, since each group costs a dozen kernel launches per layer."""
    block_size = 16
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(32)]
    chunks = [SequenceChunk(40 + 8 * i, 1, tables[i]) for i in range(32)]
    key_bytes = 4 * 256 * 4  # 4 KV heads of 256 floats

    def groups(device: torch.device) -> list[int]:
        metadata = AttentionMetadata.build(
            chunks, block_size=block_size, num_blocks=640, device=device, key_bytes=key_bytes
        )
        return [g.token_index.shape[0] for g in metadata.groups]

    assert len(groups(CPU)) > 8
    assert groups(torch.device("meta")) == [32]
    # A long prefill chunk still gets a group of its own on a GPU: padding 32 decodes to its
    # 2,048 queries would cost far more than its launches. (After a cached block: a fresh
    # one would be a `FreshPrefill`, outside the groups.)
    chunks.append(SequenceChunk(16, 2048, list(range(129))))
    metadata = AttentionMetadata.build(
        chunks, block_size=block_size, num_blocks=640, device=torch.device("meta")
    )
    assert sorted(g.token_index.shape for g in metadata.groups) == [(1, 2048), (32, 1)]


def test_attention_on_cuda_runs_without_cudnn_and_leaves_the_choice_as_it_was() -> None:
    """cuDNN plans every new shape anew, and a serving step's shapes keep changing: the
    runner's steps on CUDA leave it out of SDPA's choice; on CPU (no cuDNN) nothing changes.
    The flags are process-wide, so both are restored after the step."""
    # torch leaves these switches unannotated; each answers whether its backend is on.
    cudnn: Callable[[], bool] = torch.backends.cuda.cudnn_sdp_enabled
    mem_efficient: Callable[[], bool] = torch.backends.cuda.mem_efficient_sdp_enabled
    math: Callable[[], bool] = torch.backends.cuda.math_sdp_enabled
    before = (cudnn(), mem_efficient(), math())
    with sdpa_backends(torch.device("cuda")):
        assert not cudnn()
        assert mem_efficient() and math()
    with sdpa_backends(CPU):
        assert cudnn() == before[0]
    assert (cudnn(), mem_efficient(), math()) == before


def test_attention_metadata_rejects_a_block_table_too_short_or_out_of_range() -> None:
    with pytest.raises(KvCacheError):
        AttentionMetadata.build([SequenceChunk(0, 5, [0])], block_size=4, num_blocks=8, device=CPU)
    with pytest.raises(KvCacheError):
        AttentionMetadata.build([SequenceChunk(0, 3, [8])], block_size=4, num_blocks=8, device=CPU)


def paged_logits_in_chunks(
    model_dir: Path, tokens: list[int], chunks: list[int], *, native: bool = False
) -> torch.Tensor:
    """With `native`, the forward runs its native kernels (where they build)."""
    model = load_model(model_dir)
    kernels = load_kernels() if native else None
    cfg = model.config
    block_size = 5
    table = list(range(-(-len(tokens) // block_size)))[::-1]  # reversed: non-trivial layout
    cache = PagedKvCache(
        num_layers=cfg.num_layers,
        num_blocks=len(table),
        block_size=block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=model.dtype,
        device=CPU,
    )
    pieces = []
    start = 0
    with torch.inference_mode():
        for size in chunks:
            metadata = AttentionMetadata.build(
                [SequenceChunk(start, size, table)],
                block_size=block_size,
                num_blocks=len(table),
                device=CPU,
                kernel_rows=kernels is not None,
            )
            ids = torch.tensor(tokens[start : start + size])
            hidden = model.forward(ids, metadata, cache, start + size - 1, native=kernels)
            pieces.append(model.compute_logits(hidden))
            start += size
    return torch.cat(pieces)


@pytest.mark.parametrize("native", [True, False], ids=["native-if-built", "torch"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_paged_model_logits_equal_a_dense_float64_forward(
    family: str, native: bool, tmp_path: Path
) -> None:
    if family == "llama":
        model_dir = TINY_LLAMA
        tokens = vllm_requests()[0]["prompt_token_ids"][:90]
    else:
        model_dir = write_random_qwen2(tmp_path / "qwen2")
        tokens = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(7)).tolist()
    # Chunked prefill (37 + 40) then 13 single-token decode steps.
    paged = paged_logits_in_chunks(model_dir, tokens, [37, 40] + [1] * 13, native=native)
    dense = dense_logits(model_dir, tokens)
    assert paged.dtype == torch.float32
    torch.testing.assert_close(paged.double(), dense, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(
        paged.double().log_softmax(-1), dense.log_softmax(-1), atol=1e-4, rtol=1e-5
    )


@pytest.mark.parametrize("native_kernels", [None, False], ids=["kernel-if-built", "torch"])
def test_greedy_decoding_reproduces_vllm_outputs_for_every_request(
    native_kernels: bool | None,
) -> None:
    requests = vllm_requests()
    assert len(requests) == 30
    assert all(r["sampling"]["temperature"] == 0.0 for r in requests)
    runner = TorchModelRunner.from_pretrained(
        TINY_LLAMA, block_size=16, num_blocks=30 * 21, native_kernels=native_kernels
    )
    assert (runner.native_kernels is not None) == (native_kernels is None and compiler_available())
    sequences = vllm_sequences(requests, logprobs=LogprobRequest())
    # All 30 together: mixed prompt lengths, chunked prefill, batched decodes.
    drive(runner, sequences, chunk_tokens=64)
    mismatches = [
        r["req_seq"]
        for r, s in zip(requests, sequences, strict=True)
        if s.outputs != r["output_token_ids"]
    ]
    assert mismatches == []
    # The chosen tokens' logprobs are the model's own (checked against the float64 reference).
    for seq in sequences[:2]:
        dense = dense_logits(TINY_LLAMA, seq.tokens).log_softmax(-1)
        positions = range(len(seq.prompt) - 1, len(seq.tokens) - 1)
        expected = [float(dense[p, seq.tokens[p + 1]]) for p in positions]
        got = [r.logprob.logprob for r in seq.results if r.logprob is not None]
        assert got == pytest.approx(expected, abs=1e-4)
        assert all(r.logprob.rank == 1 for r in seq.results if r.logprob is not None)


def test_qwen2_greedy_equals_dense_reference_greedy(tmp_path: Path) -> None:
    model_dir = write_random_qwen2(tmp_path / "qwen2")
    config = ModelConfig.from_dir(model_dir)
    assert config.architecture is Architecture.QWEN2
    assert (config.num_heads, config.num_kv_heads, config.tie_word_embeddings) == (4, 2, True)
    assert config.qkv_bias and not config.o_bias
    runner = TorchModelRunner.from_pretrained(model_dir, block_size=4, num_blocks=64)
    prompt = [1, 17, 250, 33, 4, 99, 120, 7, 7, 64, 200]
    seq = DrivenSequence(
        seq_id=0,
        prompt=prompt,
        max_tokens=12,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True, logprobs=LogprobRequest()),
    )
    drive(runner, [seq], chunk_tokens=4)
    expected = list(prompt)
    expected_logprobs = []
    for _ in range(12):
        row = dense_logits(model_dir, expected)[-1].log_softmax(-1)
        expected.append(int(row.argmax()))
        expected_logprobs.append(float(row.max()))
    assert seq.tokens == expected
    got = [r.logprob.logprob for r in seq.results if r.logprob is not None]
    assert got == pytest.approx(expected_logprobs, abs=1e-4)


def test_prompt_logprobs_across_chunks_equal_the_reference() -> None:
    runner = TorchModelRunner.from_pretrained(TINY_LLAMA, block_size=8, num_blocks=64)
    prompt = vllm_requests()[3]["prompt_token_ids"][:50]
    seq = DrivenSequence(
        seq_id=0,
        prompt=prompt,
        max_tokens=1,
        prompt_logprobs=LogprobRequest(top_n=3),
    )
    drive(runner, [seq], chunk_tokens=16)
    got = [lp for r in seq.results for lp in r.prompt_logprobs]
    dense = dense_logits(TINY_LLAMA, prompt).log_softmax(-1)
    # One entry per prompt token after the first, in order.
    assert [lp.token_id for lp in got] == prompt[1:]
    expected = [float(dense[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert [lp.logprob for lp in got] == pytest.approx(expected, abs=1e-4)
    for p, lp in enumerate(got, start=1):
        assert lp.rank == int((dense[p - 1] > dense[p - 1, prompt[p]]).sum()) + 1
        assert [c.token_id for c in lp.candidates] == dense[p - 1].topk(3).indices.tolist()


def test_bfloat16_rms_norm_is_the_reference_arithmetic_bit_for_bit() -> None:
    """In bfloat16 the norm is one fused float32 op plus casts: the same values as the
    reference's normalise-in-float32, cast back, then scale by the weight."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(33, 256, generator=g) * 4).to(torch.bfloat16)
    weight = torch.randn(256, generator=g).to(torch.bfloat16)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(rms_norm(x, weight, 1e-5), weight * normed.to(torch.bfloat16))


def test_bfloat16_loads_and_generates_close_to_float32() -> None:
    runner = TorchModelRunner.from_pretrained(
        TINY_LLAMA, dtype="bfloat16", block_size=16, num_blocks=64
    )
    assert runner.model.weights.embed_tokens.dtype == torch.bfloat16
    assert runner.kv_cache.keys[0].dtype == torch.bfloat16
    prompt = vllm_requests()[0]["prompt_token_ids"]
    seq = DrivenSequence(
        seq_id=0,
        prompt=prompt,
        max_tokens=8,
        sampling=SamplingParams(temperature=0.0, logprobs=LogprobRequest()),
        prompt_logprobs=LogprobRequest(),
    )
    drive(runner, [seq], chunk_tokens=64)
    assert len(seq.outputs) == 8
    got = torch.tensor([lp.logprob for r in seq.results for lp in r.prompt_logprobs])
    dense = dense_logits(TINY_LLAMA, prompt).log_softmax(-1)
    expected = torch.tensor([float(dense[p - 1, prompt[p]]) for p in range(1, len(prompt))])
    # bf16 keeps ~3 significant digits: close to the float64 model, but not float32-close.
    assert (got - expected).abs().mean() < 0.01
    assert (got - expected).abs().max() > 1e-6


@pytest.mark.parametrize(
    ("name", "num_gpus", "refusal"),
    [
        ("cuda:0", 0, "device 'cuda:0' requested but CUDA is not available: no GPU visible"),
        ("cuda", 0, "device 'cuda' requested but CUDA is not available: no GPU visible"),
        ("cuda:1", 1, "device 'cuda:1' does not exist: 1 GPU visible (cuda:0)"),
        ("cuda:2", 2, "device 'cuda:2' does not exist: 2 GPUs visible (cuda:0 to cuda:1)"),
        ("cuda:9", 8, "device 'cuda:9' does not exist: 8 GPUs visible (cuda:0 to cuda:7)"),
        ("mps", 1, "device type 'mps' is not supported (cpu or cuda)"),
    ],
)
def test_a_device_this_machine_lacks_is_refused_by_name(
    name: str, num_gpus: int, refusal: str
) -> None:
    """torch takes `cuda:N` for any N and fails only when the first tensor lands there."""
    with pytest.raises(CheckpointError) as refused:
        check_device(name, num_gpus)
    assert str(refused.value) == refusal


@pytest.mark.parametrize(
    ("name", "num_gpus"), [("cpu", 0), ("cuda", 1), ("cuda:0", 1), ("cuda:1", 2), ("cuda:7", 8)]
)
def test_a_device_this_machine_has_is_taken(name: str, num_gpus: int) -> None:
    assert check_device(name, num_gpus) == torch.device(name)


def test_loader_refuses_missing_or_unsupported_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_model(tmp_path)
    model_dir = tmp_path / "copy"
    shutil.copytree(TINY_LLAMA, model_dir)
    with pytest.raises(CheckpointError, match="dtype"):
        load_model(model_dir, dtype="float8")
    with pytest.raises(CheckpointError, match="not supported"):
        load_model(model_dir, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="CUDA is not available"):
            load_model(model_dir, device="cuda")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load_model(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="hidden_act"):
        load_model(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config | {"intermediate_size": 512}))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    tied = load_model(model_dir).weights
    assert tied.lm_head is tied.embed_tokens
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(model_dir)


def test_engine_core_end_to_end_reproduces_vllm_outputs() -> None:
    """vLLM's own settings (block size 32, 48 blocks, 8 seats, prefix caching), phases replayed
    in order: concurrent batches share prefixes, hit the cache, get preempted and chunked."""
    runner = TorchModelRunner.from_pretrained(
        TINY_LLAMA, block_size=32, num_blocks=48, max_model_len=512
    )
    core = EngineCore(
        runner,
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        tokenizer=load_tokenizer(TINY_LLAMA),
    )
    requests = vllm_requests()
    outputs: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    cached: dict[str, int] = {}
    num_preempted = 0
    # Requests submitted at the same instant in the capture were one concurrent batch.
    for submit_time in sorted({r["submit_time_unix"] for r in requests}):
        group = [r for r in requests if r["submit_time_unix"] == submit_time]
        if group[0]["req_seq"] == 28:  # the capture reset the prefix cache before P7
            assert core.reset_prefix_cache()
        for r in group:
            core.add_request(
                EngineRequest(
                    request_id=r["vllm_request_id"],
                    prompt_token_ids=tuple(r["prompt_token_ids"]),
                    sampling=SamplingParams(
                        temperature=0.0,
                        max_tokens=r["sampling"]["max_tokens"],
                        ignore_eos=r["sampling"]["ignore_eos"],
                    ),
                    cache_salt=r["cache_salt"],
                )
            )
        while core.has_work():
            step = core.step()
            if step.stats is not None:
                num_preempted += step.stats.num_preempted
            for out in step.outputs:
                if out.usage is not None:
                    cached[out.request_id] = out.usage.cached_prompt_tokens
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
                assert out.finish_reason in (None, FinishReason.LENGTH)
    assert {r["vllm_request_id"]: r["output_token_ids"] for r in requests} == outputs
    tokenizer = load_tokenizer(TINY_LLAMA)
    assert all(texts[k] == finished_text(tokenizer, v) for k, v in outputs.items())
    assert core.load().num_running == 0
    # The workload exercised preemption (recomputed sequences still match) and prefix hits;
    # every request hits the cache exactly as much as in vLLM, one admitted in the same step
    # as the request computing its prefix too (vLLM caches a block when its chunk is scheduled).
    assert num_preempted >= 1
    assert cached == {r["vllm_request_id"]: r["num_cached_tokens"] for r in requests}
    assert sum(cached.values()) >= 1000


def test_runner_sizes_the_cache_and_refuses_impossible_steps() -> None:
    runner = TorchModelRunner.from_pretrained(
        TINY_LLAMA, block_size=8, kv_cache_bytes=64 * 16384 + 100, max_model_len=40
    )
    # 2 layers x (K, V) x 8 tokens x 2 heads x 64 dims x 4 bytes = 16 KiB per block.
    assert runner.num_blocks == 64
    assert runner.eos_token_ids == frozenset({2})
    assert (runner.vocab_size, runner.max_model_len) == (1024, 40)
    with pytest.raises(KvCacheError):
        TorchModelRunner.from_pretrained(TINY_LLAMA, num_blocks=4, kv_cache_bytes=1 << 20)
    with pytest.raises(KvCacheError, match="max_model_len 100000 is beyond the model's "):
        TorchModelRunner.from_pretrained(TINY_LLAMA, num_blocks=64, max_model_len=100_000)
    with pytest.raises(KvCacheError, match="holds no block"):
        TorchModelRunner.from_pretrained(TINY_LLAMA, kv_cache_bytes=100)
    for prompt in ([5, 1024, 6], [5] * 41):  # a token outside the vocabulary; past the context
        seq = DrivenSequence(seq_id=0, prompt=prompt, max_tokens=1)
        with pytest.raises(InvalidBatchError):
            drive(runner, [seq], chunk_tokens=64)


def test_engine_core_seeded_sampling_with_logprobs_is_reproducible_in_any_batch() -> None:
    prompts = [tuple(r["prompt_token_ids"][:60]) for r in vllm_requests()[12:15]]
    sampling = SamplingParams(
        temperature=0.9,
        top_p=0.95,
        seed=7,
        num_sequences=2,
        max_tokens=10,
        ignore_eos=True,
        logprobs=LogprobRequest(top_n=2),
        prompt_logprobs=LogprobRequest(),
    )

    def run(with_others: bool) -> dict[str, list[Any]]:
        runner = TorchModelRunner.from_pretrained(TINY_LLAMA, block_size=16, num_blocks=64)
        core = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=64))
        core.add_request(EngineRequest("x", prompts[0], sampling))
        if with_others:
            for i, prompt in enumerate(prompts[1:]):
                core.add_request(EngineRequest(f"o{i}", prompt, SamplingParams(max_tokens=5)))
        seen: dict[str, list[Any]] = {"0": [], "1": [], "logprobs": [], "prompt": []}
        while core.has_work():
            for out in core.step().outputs:
                if out.request_id != "x":
                    continue
                seen[str(out.output_index)].extend(out.new_token_ids)
                seen["logprobs"].extend(out.logprobs or ())
                if out.prompt_logprobs is not None:
                    seen["prompt"].append(out.prompt_logprobs)
        return seen

    alone, crowded = run(with_others=False), run(with_others=True)
    assert alone["0"] == crowded["0"] and alone["1"] == crowded["1"]
    assert alone["0"] != alone["1"]  # outputs sample with seed + output_index
    assert len(alone["0"]) == len(alone["1"]) == 10
    assert all(len(lp.candidates) == 2 for lp in alone["logprobs"])
    [prompt_logprobs] = alone["prompt"]
    assert len(prompt_logprobs) == len(prompts[0])
    assert prompt_logprobs[0] is None
    assert [lp.token_id for lp in prompt_logprobs[1:]] == list(prompts[0][1:])
