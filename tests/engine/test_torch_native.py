"""The optional native kernels: they build where a C compiler exists, compute what dense
attention and the torch ops they replace compute, refuse what would make the C code read
outside its tensors, and when they cannot be built the runner falls back to torch and still
reproduces vLLM's greedy outputs."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.torch_runner import native
from engine.torch_runner.errors import KvCacheError
from engine.torch_runner.model import apply_rotary, rms_norm
from engine.torch_runner.runner import TorchModelRunner
from tests.engine.torch_reference import TINY_LLAMA, drive, vllm_requests, vllm_sequences
from tests.processes import descendants, wait_gone

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fresh_kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty build cache and a forgotten per-process kernel (restored afterwards)."""
    monkeypatch.delenv("KVPLANE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.load_kernels.cache_clear()
    yield tmp_path / "kvplane" / "native"
    native.load_kernels.cache_clear()


@pytest.fixture(scope="module")
def _kernel_built_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache home where the kernels were built from nothing, once for this module (a build
    takes seconds; building from an empty cache is what each test checks the result of)."""
    home = tmp_path_factory.mktemp("kernel-cache-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("KVPLANE_CACHE_DIR", raising=False)
        patch.setenv("XDG_CACHE_HOME", str(home))
        native.load_kernels.cache_clear()
        native.load_kernels()
        native.load_kernels.cache_clear()
    return home


@pytest.fixture
def built_kernel_cache(_kernel_built_once: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """`fresh_kernel_cache` after its first build: what that build left in it, and a
    per-process kernel loaded from it afresh (restored afterwards)."""
    monkeypatch.delenv("KVPLANE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(_kernel_built_once))
    native.load_kernels.cache_clear()
    yield _kernel_built_once / "kvplane" / "native"
    native.load_kernels.cache_clear()


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query [H, D] over keys/values [L, KVH, D], in float64."""
    repeat = q.shape[0] // k.shape[1]
    k64 = k.double().repeat_interleave(repeat, 1)
    v64 = v.double().repeat_interleave(repeat, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k64) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v64)


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    # head_dim 64 and 128 take the register-accumulator paths, 160 the one in memory.
    [(2, 1, 64, 16), (4, 2, 64, 16), (2, 2, 128, 16), (1, 3, 12, 5), (3, 1, 8, 1), (1, 2, 160, 4)],
)
def test_kernel_builds_with_a_compiler_and_equals_dense_attention(
    built_kernel_cache: Path, num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    kernel = native.load_kernels()
    assert (kernel is not None) == native.compiler_available()
    if kernel is None:  # no compiler here: nothing is built, the runner uses torch
        assert not built_kernel_cache.exists() or not any(built_kernel_cache.iterdir())
        return
    assert [p.suffix for p in built_kernel_cache.iterdir()] == [".so"]
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
    # Two more rows read sequence 3's table with shorter lengths: a prefill chunk's causal
    # window over its own blocks.
    table_rows = [0, 1, 2, 3, 4, 3, 3]
    row_lengths = [*lengths, 1, 2 * block_size + 1]
    num_heads = num_kv_heads * group
    query = torch.randn(len(row_lengths), num_heads, head_dim, generator=g)
    out = kernel.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables=torch.tensor(tables),
        table_rows=torch.tensor(table_rows),
        lengths=torch.tensor(row_lengths),
        scale=head_dim**-0.5,
    )
    for b, (t, n) in enumerate(zip(table_rows, row_lengths, strict=True)):
        rows = key_cache[tables[t]].flatten(0, 1)[:n], value_cache[tables[t]].flatten(0, 1)[:n]
        expected = dense_decode(query[b], *rows)
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)
    # The second load in another process would find the cached library: same file, no rebuild.
    built = native._build()
    assert built.parent == built_kernel_cache
    # What would make the C code read outside the tensors is refused before it runs.
    bad_block = [list(row) for row in tables]
    bad_block[0][0] = num_blocks
    good_tables, good_lengths = torch.tensor(tables), torch.tensor(row_lengths)
    good_rows = torch.tensor(table_rows)
    too_long = [*row_lengths[:-1], width * block_size + 1]
    for bad_query, bad_tables, bad_rows, bad_lengths, match in (
        (query.double(), good_tables, good_rows, good_lengths, "float32"),
        (query, good_tables, good_rows, torch.tensor(too_long), "range"),
        (query, good_tables, good_rows, torch.tensor([0, *row_lengths[1:]]), "range"),
        (query, torch.tensor(bad_block), good_rows, good_lengths, "range"),
        (query, good_tables, torch.tensor([*table_rows[:-1], len(tables)]), good_lengths, "range"),
        (query, good_tables, good_rows[:-1], good_lengths, "shapes"),
    ):
        with pytest.raises(ValueError, match=match):
            kernel.paged_attention(
                bad_query,
                key_cache,
                value_cache,
                block_tables=bad_tables,
                table_rows=bad_rows,
                lengths=bad_lengths,
                scale=1.0,
            )


@pytest.fixture
def kernels() -> native.NativeKernels:
    built = native.load_kernels()
    if built is None:  # the fallback is covered by the tests below
        assert not native.compiler_available()
        pytest.skip("no C compiler here")
    return built


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_the_torch_norm_and_adds_the_residual_in_place(
    kernels: native.NativeKernels, with_residual: bool
) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=g) * 3
    delta = torch.randn(37, 96, generator=g)
    weight = torch.randn(96, generator=g)
    expected_stream = x + delta if with_residual else x.clone()
    out = kernels.rms_norm(x, weight, 1e-6, add=delta if with_residual else None)
    torch.testing.assert_close(out, rms_norm(expected_stream, weight, 1e-6), atol=1e-6, rtol=1e-6)
    assert torch.equal(x, expected_stream)
    with pytest.raises(ValueError, match="rms_norm"):
        kernels.rms_norm(x, weight[:-1], 1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        kernels.rms_norm(x.t(), torch.ones(37), 1e-6)


def test_rope_store_rotates_in_place_like_torch_and_writes_the_slots(
    kernels: native.NativeKernels,
) -> None:
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 4, 6
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    positions = torch.tensor([0, 1, 2, 9, 30, 31, 3])
    slots = torch.tensor([20, 21, 22, 5, 0, 1, 23])
    angles = torch.rand(32, head_dim // 2, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    heads = qkv.view(7, -1, head_dim)
    qk = heads[:, : num_heads + num_kv_heads]
    expected_qk = apply_rotary(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    expected_v = heads[:, num_heads + num_kv_heads :].clone()
    rope_store = functools.partial(
        kernels.rope_store, cos=cos, sin=sin, key_cache=key_cache, value_cache=value_cache
    )
    rope_store(qkv, positions=positions, slots=slots, num_heads=num_heads)
    assert torch.equal(qk, expected_qk)  # the same arithmetic: bit-identical
    flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
    flat_values = value_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_keys[slots], expected_qk[:, num_heads:])
    assert torch.equal(flat_values[slots], expected_v)
    untouched = [s for s in range(num_blocks * block_size) if s not in slots.tolist()]
    assert not flat_keys[untouched].any() and not flat_values[untouched].any()
    for bad_positions, bad_slots in (
        (torch.tensor([0, 1, 2, 9, 32, 31, 3]), slots),
        (positions, torch.tensor([20, 21, 22, 5, 0, 1, 24])),
        (positions, torch.tensor([20, 21, 22, -1, 0, 1, 23])),
    ):
        with pytest.raises(ValueError, match="out of range"):
            rope_store(qkv, positions=bad_positions, slots=bad_slots, num_heads=num_heads)
    with pytest.raises(ValueError, match="shapes"):
        rope_store(qkv, positions=positions, slots=slots, num_heads=num_heads + 1)


def test_silu_mul_equals_torch(kernels: native.NativeKernels) -> None:
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(19, 2 * 40, generator=g) * 8  # saturated tails on both sides
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="silu_mul"):
        kernels.silu_mul(gate_up[:, :-1])


def test_a_source_that_does_not_compile_leaves_the_torch_path(
    fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "_SOURCE", "this is not C;")
    assert native.load_kernels() is None
    runner = TorchModelRunner.from_pretrained(TINY_LLAMA, block_size=16, num_blocks=64)
    assert runner.native_kernels is None
    with pytest.raises(KvCacheError, match="not available"):
        TorchModelRunner.from_pretrained(
            TINY_LLAMA, block_size=16, num_blocks=64, native_kernels=True
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
    assert native.load_kernels() is None
    runner = TorchModelRunner.from_pretrained(TINY_LLAMA, block_size=16, num_blocks=64)
    assert runner.native_kernels is None


def test_bfloat16_runs_without_the_kernel() -> None:
    runner = TorchModelRunner.from_pretrained(
        TINY_LLAMA, dtype="bfloat16", block_size=16, num_blocks=64
    )
    assert runner.native_kernels is None


def test_kernels_are_built_under_kvplane_cache_dir_as_models_are(
    fresh_kernel_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`$KVPLANE_CACHE_DIR` moves all of kvplane's cache (the builtin model's too), not the
    models alone."""
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path / "kvplane-cache"))
    if native.load_kernels() is None:  # no compiler here: nothing is built
        assert not native.compiler_available()
        return
    assert native._build().parent == tmp_path / "kvplane-cache" / "native"
    assert not fresh_kernel_cache.exists()


def test_an_unwritable_cache_directory_falls_back_to_the_temp_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_directory = tmp_path / "cache-is-a-file"
    not_a_directory.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_directory))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    native.load_kernels.cache_clear()
    try:
        kernel = native.load_kernels()
        assert (kernel is not None) == native.compiler_available()
        if kernel is not None:
            assert native._build().parent.parent == tmp_path / "tmp"
    finally:
        native.load_kernels.cache_clear()


# A first compile held open until it is stopped (a real one takes seconds; no compiler needed).
_COMPILE_UNTIL_STOPPED = """
import time
from engine.torch_runner import native

def held_open(command):
    print("compiling", flush=True)
    time.sleep(600)

native._compiler = lambda: "cc"
native._compile = held_open
native.load_kernels()
"""


def test_a_compile_stopped_by_sigterm_leaves_no_scratch_in_the_cache(tmp_path: Path) -> None:
    # `kvplane up` stops engines still starting with SIGTERM: Ctrl-C during a first start.
    cache = tmp_path / "xdg" / "kvplane" / "native"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
    }
    with subprocess.Popen(
        [sys.executable, "-c", _COMPILE_UNTIL_STOPPED],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    ) as build:  # fmt: skip
        assert build.stdout is not None
        assert build.stdout.readline() == b"compiling\n"
        assert len(list(cache.iterdir())) == 1  # its scratch
        build.send_signal(signal.SIGTERM)
        _, errors = build.communicate(timeout=60)
    assert build.returncode == -signal.SIGTERM, errors  # still reads as killed by SIGTERM
    assert list(cache.iterdir()) == []


# A first compile by the real compiler, held open: its source includes a FIFO that nobody
# opens for writing, so the compiler proper (`cc1`, the `cc` driver's child) waits in it.
_COMPILE_HELD_ON_A_FIFO = """
import sys
from engine.torch_runner import native

native._SOURCE = '#include "' + sys.argv[1] + '"\\n'
native.load_kernels()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop", ["sigterm", "group_sigkill"])
def test_a_stopped_compile_leaves_no_compiler_process(tmp_path: Path, stop: str) -> None:
    """SIGTERM (`kvplane up` stopping an engine that compiles its kernels on first use) ends
    the compiler's whole process tree with the engine: killing the `cc` driver alone left
    `cc1` compiling on, an orphan. So does a SIGKILL of the engine's process group (`kvplane
    up` killing a member past `stop_timeout_s`): the compiler is in that group."""
    assert native.compiler_available()
    fifo = tmp_path / "held.h"
    os.mkfifo(fifo)
    env = {
        **{k: v for k, v in os.environ.items() if k != "KVPLANE_CACHE_DIR"},
        "PYTHONPATH": os.pathsep.join(sys.path),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
    }
    compile_processes: list[int] = []
    with subprocess.Popen(
        [sys.executable, "-c", _COMPILE_HELD_ON_A_FIFO, str(fifo)],
        stderr=subprocess.PIPE, env=env, start_new_session=True,
    ) as build:  # fmt: skip
        try:
            # The driver and the compiler proper it runs, waiting in the FIFO.
            while len(compile_processes) < 2 and build.poll() is None:
                time.sleep(0.05)
                compile_processes = descendants(build.pid)
            assert len(compile_processes) >= 2, build.stderr
            if stop == "sigterm":
                build.send_signal(signal.SIGTERM)
                _, errors = build.communicate(timeout=30)
                assert build.returncode == -signal.SIGTERM, errors
            else:
                os.killpg(build.pid, signal.SIGKILL)
                build.communicate(timeout=30)
            # Time to die, not to finish: the FIFO holds the compiler until it is killed.
            assert wait_gone(compile_processes, 10) == []
        finally:
            for pid in compile_processes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    if stop == "sigterm":  # (SIGKILL runs no cleanup: its scratch is left, as documented)
        assert list((tmp_path / "xdg" / "kvplane" / "native").iterdir()) == []
