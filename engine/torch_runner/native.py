"""An optional C kernel for decode attention straight out of the paged KV cache.

Why. A decode step's attention on CPU is memory-bound: every sequence's keys and values are
read once. Through torch, each layer first gathers each sequence's blocks into a contiguous
tensor (a copy as large as the context) and pads the group to its longest member; this kernel
reads the blocks in place, one sequence and one position at a time, so it reads exactly the
context and copies nothing.

What. `kernel(query [B, H, D], key_cache, value_cache [blocks, block_size, KVH, D], *,
block_tables [B, max_blocks] int64, lengths [B] int64, scale) -> [B, H, D]`: query b attends
to positions 0 .. lengths[b] - 1 of its own blocks (float32 only). Scores, softmax and the
weighted sum are computed in float32 in plain C (loops the compiler vectorises); one thread.

How it is built. The source below is compiled once per machine with the system C compiler
(`cc`/`gcc`, `-O3 -march=native`, falling back to `-O3`) into a shared library cached under
the user's cache directory (keyed by the source, the flags and the CPU), and called through
ctypes with the tensors' data pointers (no torch headers, no Python extension ABI). When no
compiler is found, compilation fails or the library cannot be loaded, `load_kernel()` returns
None and the caller keeps the torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* q [B, H, D]; caches [blocks, block_size, KVH, D]; tables [B, table_stride]; out [B, H, D];
   scores: scratch of H * max(lengths) floats. Loops run block by block and head group by head
   group, so no position or head index is divided at run time. */
int kvplane_decode_attention(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
    int64_t table_stride, const int64_t *lengths, float *out, float *scores, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    const int64_t block_floats = block_size * row;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t len = lengths[b];
        const int64_t *table = tables + b * table_stride;
        const float *qb = q + b * num_heads * head_dim;
        float *ob = out + b * num_heads * head_dim;
        for (int64_t first = 0, j = 0; first < len; first += block_size, j++) {
            const float *kb = k_cache + table[j] * block_floats;
            const int64_t n = len - first < block_size ? len - first : block_size;
            for (int64_t t = 0; t < n; t++) {
                const float *kp = kb + t * row;
                for (int64_t g = 0; g < num_kv_heads; g++) {
                    const float *k = kp + g * head_dim;
                    for (int64_t i = 0; i < group; i++) {
                        const int64_t h = g * group + i;
                        scores[h * len + first + t] = dot(qb + h * head_dim, k, head_dim) * scale;
                    }
                }
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            float *s = scores + h * len;
            float top = s[0];
            for (int64_t p = 1; p < len; p++) top = s[p] > top ? s[p] : top;
            float sum = 0.0f;
            for (int64_t p = 0; p < len; p++) {
                s[p] = expf(s[p] - top);
                sum += s[p];
            }
            float inv = 1.0f / sum;
            for (int64_t p = 0; p < len; p++) s[p] *= inv;
        }
        memset(ob, 0, (size_t)(num_heads * head_dim) * sizeof(float));
        for (int64_t first = 0, j = 0; first < len; first += block_size, j++) {
            const float *vb = v_cache + table[j] * block_floats;
            const int64_t n = len - first < block_size ? len - first : block_size;
            for (int64_t t = 0; t < n; t++) {
                const float *vp = vb + t * row;
                for (int64_t g = 0; g < num_kv_heads; g++) {
                    const float *v = vp + g * head_dim;
                    for (int64_t i = 0; i < group; i++) {
                        const int64_t h = g * group + i;
                        const float w = scores[h * len + first + t];
                        float *o = ob + h * head_dim;
                        for (int64_t d = 0; d < head_dim; d++) o[d] += w * v[d];
                    }
                }
            }
        }
    }
    return 0;
}
"""

_FLAG_SETS = (("-O3", "-march=native"), ("-O3",))


class DecodeAttentionKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.kvplane_decode_attention
        fn.restype = ctypes.c_int
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32]
        self._fn = fn

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        block_tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """See the module docstring. Everything the C code relies on to stay inside the
        tensors is checked here first (a few microseconds); a violation is a ValueError."""
        num_seqs, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        if not (
            query.dtype == key_cache.dtype == value_cache.dtype == torch.float32
            and block_tables.dtype == lengths.dtype == torch.int64
            and query.is_contiguous()
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and block_tables.is_contiguous()
            and lengths.is_contiguous()
            and query.device.type == key_cache.device.type == "cpu"
            and key_cache.shape[3] == head_dim
            and value_cache.shape == key_cache.shape
            and num_heads % num_kv_heads == 0
            and block_tables.shape[0] == lengths.shape[0] == num_seqs
        ):
            raise ValueError("decode_attention: float32 contiguous CPU tensors of matching shapes")
        if num_seqs == 0:
            return torch.empty_like(query)
        shortest, longest = (int(x) for x in torch.aminmax(lengths))
        lowest, highest = (int(x) for x in torch.aminmax(block_tables))
        if (
            shortest < 1
            or longest > block_tables.shape[1] * block_size
            or lowest < 0
            or highest >= key_cache.shape[0]
        ):
            raise ValueError("decode_attention: a length or block id is out of range")
        scratch = torch.empty(num_heads * longest)  # one thread's scores: per call, no sharing
        out = torch.empty_like(query)
        self._fn(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            lengths.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
        )
        return out


@functools.cache
def load_kernel() -> DecodeAttentionKernel | None:
    """The compiled kernel, built on first use (once per process); None when unavailable."""
    try:
        return DecodeAttentionKernel(ctypes.CDLL(str(_build())))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("decode attention kernel unavailable, using torch: %s", exc)
        return None


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    """The user's cache directory, or a per-user one under the temp directory when that cannot
    be created (a read-only home)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    directory = Path(base) / "kvplane" / "native"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        directory = Path(tempfile.gettempdir()) / f"kvplane-native-{os.getuid()}"
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def compiler_available() -> bool:
    """Whether a C compiler is on PATH (then the kernel is expected to build)."""
    return _compiler() is not None


def _build() -> Path:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    errors: list[str] = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(
            "\n".join([_SOURCE, compiler, *flags, platform.machine(), _cpu_signature()]).encode()
        ).hexdigest()[:16]
        target = _cache_dir() / f"decode_attention_{key}.so"
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            source = Path(scratch) / "kernel.c"
            source.write_text(_SOURCE)
            built = Path(scratch) / "kernel.so"
            command = [
                compiler,
                *flags,
                "-std=c99",
                "-shared",
                "-fPIC",
                "-o",
                str(built),
                str(source),
            ]
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode == 0:
                os.replace(built, target)  # atomic: concurrent builders agree
                return target
            errors.append(f"{' '.join(flags)}: {done.stderr.strip()[:300]}")
    raise RuntimeError("compiling the kernel failed: " + "; ".join(errors))
