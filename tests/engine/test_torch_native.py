"""The optional native decode-attention kernel: it builds where a C compiler exists, computes
what dense attention computes, and when it cannot be built the runner falls back to torch and
still reproduces vLLM's greedy outputs."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch_reference import TINY_LLAMA, drive, vllm_requests, vllm_sequences

from engine.torch_runner import native
from engine.torch_runner.errors import KvCacheError
from engine.torch_runner.runner import TorchModelRunner


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fresh_kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty build cache and a forgotten per-process kernel (restored afterwards)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.load_kernel.cache_clear()
    yield tmp_path / "kvplane" / "native"
    native.load_kernel.cache_clear()


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query [H, D] over keys/values [L, KVH, D], in float64."""
    repeat = q.shape[0] // k.shape[1]
    k64 = k.double().repeat_interleave(repeat, 1)
    v64 = v.double().repeat_interleave(repeat, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k64) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v64)


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(2, 1, 64, 16), (4, 2, 64, 16), (1, 3, 12, 5), (3, 1, 8, 1)],
)
def test_kernel_builds_with_a_compiler_and_equals_dense_attention(
    fresh_kernel_cache: Path, num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    kernel = native.load_kernel()
    assert (kernel is not None) == native.compiler_available()
    if kernel is None:  # no compiler here: nothing is built, the runner uses torch
        assert not fresh_kernel_cache.exists() or not any(fresh_kernel_cache.iterdir())
        return
    assert [p.suffix for p in fresh_kernel_cache.iterdir()] == [".so"]
    g = torch.Generator().manual_seed(num_kv_heads * 100 + head_dim)
    lengths = [1, 7, block_size, 3 * block_size + 2, 40]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    width = max(-(-n // block_size) for n in lengths)
    tables = []
    for n in lengths:
        used = -(-n // block_size)
        tables.append(pool[:used] + [0] * (width - used))
        pool = pool[used:]
    num_heads = num_kv_heads * group
    query = torch.randn(len(lengths), num_heads, head_dim, generator=g)
    out = kernel(
        query,
        key_cache,
        value_cache,
        block_tables=torch.tensor(tables),
        lengths=torch.tensor(lengths),
        scale=head_dim**-0.5,
    )
    for b, n in enumerate(lengths):
        rows = key_cache[tables[b]].flatten(0, 1)[:n], value_cache[tables[b]].flatten(0, 1)[:n]
        expected = dense_decode(query[b], *rows)
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)
    # The second load in another process would find the cached library: same file, no rebuild.
    built = native._build()
    assert built.parent == fresh_kernel_cache
    # What would make the C code read outside the tensors is refused before it runs.
    bad_block = [list(row) for row in tables]
    bad_block[0][0] = num_blocks
    good_tables, good_lengths = torch.tensor(tables), torch.tensor(lengths)
    for bad_query, bad_tables, bad_lengths, match in (
        (query.double(), good_tables, good_lengths, "float32"),
        (query, good_tables, torch.tensor([*lengths[:-1], width * block_size + 1]), "range"),
        (query, good_tables, torch.tensor([0, *lengths[1:]]), "range"),
        (query, torch.tensor(bad_block), good_lengths, "range"),
    ):
        with pytest.raises(ValueError, match=match):
            kernel(
                bad_query,
                key_cache,
                value_cache,
                block_tables=bad_tables,
                lengths=bad_lengths,
                scale=1.0,
            )


def test_a_source_that_does_not_compile_leaves_the_torch_path(
    fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "_SOURCE", "this is not C;")
    assert native.load_kernel() is None
    runner = TorchModelRunner.from_pretrained(TINY_LLAMA, block_size=16, num_blocks=64)
    assert runner.decode_kernel is None
    with pytest.raises(KvCacheError, match="not available"):
        TorchModelRunner.from_pretrained(
            TINY_LLAMA, block_size=16, num_blocks=64, decode_kernel=True
        )
    # The fallback runner still decodes what vLLM decoded.
    requests = vllm_requests()[:4]
    sequences = vllm_sequences(requests)
    drive(runner, sequences, chunk_tokens=64)
    assert [s.outputs for s in sequences] == [r["output_token_ids"] for r in requests]


def test_no_compiler_on_path_leaves_the_torch_path(
    fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(fresh_kernel_cache.parent / "empty-bin"))
    assert not native.compiler_available()
    assert native.load_kernel() is None
    runner = TorchModelRunner.from_pretrained(TINY_LLAMA, block_size=16, num_blocks=64)
    assert runner.decode_kernel is None


def test_bfloat16_runs_without_the_kernel() -> None:
    runner = TorchModelRunner.from_pretrained(
        TINY_LLAMA, dtype="bfloat16", block_size=16, num_blocks=64
    )
    assert runner.decode_kernel is None


def test_an_unwritable_cache_directory_falls_back_to_the_temp_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_directory = tmp_path / "cache-is-a-file"
    not_a_directory.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_directory))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    native.load_kernel.cache_clear()
    try:
        kernel = native.load_kernel()
        assert (kernel is not None) == native.compiler_available()
        if kernel is not None:
            assert native._build().parent.parent == tmp_path / "tmp"
    finally:
        native.load_kernel.cache_clear()
