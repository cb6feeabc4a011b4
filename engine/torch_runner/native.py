"""Optional C kernels for the float32 CPU forward: paged attention and the small per-layer ops.

Why. On a small model each torch op's dispatch costs more than its arithmetic (a decoder layer
was ~25 of them), and attention through torch first gathers each sequence's blocks into a
contiguous tensor and pads groups to their longest member. These kernels do the same
arithmetic in a few calls per layer, reading the KV cache in place.

What (`NativeKernels`):
- `paged_attention(query [B, H, D], key_cache, value_cache [blocks, block_size, KVH, D], *,
  block_tables [S, max_blocks], table_rows [B], lengths [B], scale) -> [B, H, D]`: query b
  attends to positions 0 .. lengths[b] - 1 of the blocks listed in row table_rows[b]. A decode
  is one row (its context); a prefill token at position p is a row of length p + 1 (causal).
  Per query head: scores eight positions at a time, softmax, weighted sum of the values
  accumulated in registers; AVX/FMA intrinsics where the compiler targets them, plain C
  otherwise.
- `rms_norm(x, weight, eps, add=None)`: RMSNorm, optionally after the residual add (in place).
- `rope_store(qkv, ...)`: rotary embedding in place on the fused q/k/v projection (the same
  arithmetic as `model.apply_rotary`, bit for bit) and the KV-cache write of k and v.
- `silu_mul(gate_up) -> silu(gate) * up`.
The exponentials (softmax, SiLU) use a vectorisable polynomial `fast_exp` (relative error
under 1e-7) instead of libm's scalar call. One thread throughout.

How it is built. The source below is compiled once per machine with the system C compiler
(`cc`/`gcc`, `-O3 -march=native`, falling back to `-O3`) into a shared library cached under
the user's cache directory (keyed by the source, the flags and the CPU), and called through
ctypes with the tensors' data pointers (no torch headers, no Python extension ABI). Every
wrapper checks dtypes, contiguity, shapes and the indices the C code follows before it runs.
The compiler runs in a process group of its own, killed whole when the compile is stopped
(SIGTERM while an engine starts, see `first_use`), so none of its processes outlives it.
When no compiler is found, compilation fails or the library cannot be loaded,
`load_kernels()` returns None and the caller keeps the torch path; the reason is logged once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.torch_runner.first_use import cache_root, sigterm_unwinds
from kvplane.process_tree import descendants

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#ifdef __FMA__
#define MUL_ADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define MUL_ADD(a, b, c) _mm256_add_ps(c, _mm256_mul_ps(a, b))
#endif
#endif

#define MAX_REGISTER_HEAD_DIM 128


/* e^x for float32 in a form that vectorises (libm's expf is a scalar call): Cody-Waite range
   reduction to r in [-ln2/2, ln2/2] and Cephes' degree-6 polynomial; relative error under 1e-7
   over the clamped range. Inputs below -87.3 give ~1e-38 instead of 0. */
static inline float fast_exp(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef __AVX__
/* fast_exp on eight lanes, the same operations in the same order (identical results); the
   clamps as min/max, which the compiler does not derive from the scalar form by itself. */
static inline __m256 fast_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(
        _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
                      _mm256_set1_ps(1.0f));
    const __m128i lo = _mm_slli_epi32(
        _mm_add_epi32(_mm_cvttps_epi32(_mm256_castps256_ps128(n)), _mm_set1_epi32(127)), 23);
    const __m128i hi = _mm_slli_epi32(
        _mm_add_epi32(_mm_cvttps_epi32(_mm256_extractf128_ps(n, 1)), _mm_set1_epi32(127)), 23);
    const __m256 scale = _mm256_insertf128_ps(
        _mm256_castps128_ps256(_mm_castsi128_ps(lo)), _mm_castsi128_ps(hi), 1);
    return _mm256_mul_ps(p, scale);
}
#endif

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float sum(const float *restrict a, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i];
    return s;
}

#ifdef __AVX__
/* The sums of eight vectors' lanes, as one vector: lane r = sum of a[r]'s lanes. */
static inline __m256 sum_lanes8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

/* One query head over one sequence's blocks: out = softmax(q . k * scale) v, the keys and
   values of its KV head at `head_offset` in each cache row. `scores`: scratch of len floats.
   Inlined with a constant head_dim, the output row is accumulated in registers (a running sum
   in memory would wait on a store-to-load round trip per position). */
static inline __attribute__((always_inline)) void attend_head(
    const float *restrict qh, const float *restrict k_cache, const float *restrict v_cache,
    const int64_t *restrict table, int64_t len, int64_t block_size, int64_t row,
    int64_t block_floats, int64_t head_offset, float scale, float *restrict scores,
    float *restrict oh, const int64_t head_dim)
{
    float top = -INFINITY;
#ifdef __AVX__
    /* Eight positions at a time: eight independent accumulators, reduced together. */
    __m256 tops = _mm256_set1_ps(-INFINITY);
    const __m256 scales = _mm256_set1_ps(scale);
#endif
    for (int64_t first = 0, j = 0; first < len; first += block_size, j++) {
        const float *kb = k_cache + table[j] * block_floats + head_offset;
        const int64_t n = len - first < block_size ? len - first : block_size;
        int64_t t = 0;
#ifdef __AVX__
        if (head_dim % 8 == 0) {
            for (; t + 8 <= n; t += 8) {
                __m256 acc[8];
                for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
                for (int64_t d = 0; d < head_dim; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + d);
                    for (int r = 0; r < 8; r++)
                        acc[r] = MUL_ADD(qv, _mm256_loadu_ps(kb + (t + r) * row + d), acc[r]);
                }
                const __m256 s = _mm256_mul_ps(sum_lanes8(acc), scales);
                _mm256_storeu_ps(scores + first + t, s);
                tops = _mm256_max_ps(tops, s);
            }
        }
#endif
        for (; t < n; t++) {
            const float s = dot(qh, kb + t * row, head_dim) * scale;
            scores[first + t] = s;
            top = s > top ? s : top;
        }
    }
#ifdef __AVX__
    float lanes[8];
    _mm256_storeu_ps(lanes, tops);
    for (int r = 0; r < 8; r++) top = lanes[r] > top ? lanes[r] : top;
#endif
    int64_t p = 0;
#ifdef __AVX__
    for (const __m256 tops8 = _mm256_set1_ps(top); p + 8 <= len; p += 8)
        _mm256_storeu_ps(scores + p, fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), tops8)));
#endif
    for (; p < len; p++) scores[p] = fast_exp(scores[p] - top);
    const float inv = 1.0f / sum(scores, len);
#ifdef __AVX__
    if (head_dim % 8 == 0 && head_dim <= MAX_REGISTER_HEAD_DIM) {
        __m256 vacc[MAX_REGISTER_HEAD_DIM / 8];
        for (int64_t c = 0; c < head_dim / 8; c++) vacc[c] = _mm256_setzero_ps();
        for (int64_t first = 0, j = 0; first < len; first += block_size, j++) {
            const float *vb = v_cache + table[j] * block_floats + head_offset;
            const int64_t n = len - first < block_size ? len - first : block_size;
            for (int64_t t = 0; t < n; t++) {
                const __m256 w = _mm256_set1_ps(scores[first + t]);
                const float *v = vb + t * row;
                for (int64_t c = 0; c < head_dim / 8; c++)
                    vacc[c] = MUL_ADD(w, _mm256_loadu_ps(v + 8 * c), vacc[c]);
            }
        }
        const __m256 invs = _mm256_set1_ps(1.0f / sum(scores, len));
        for (int64_t c = 0; c < head_dim / 8; c++)
            _mm256_storeu_ps(oh + 8 * c, _mm256_mul_ps(vacc[c], invs));
        return;
    }
#endif
    float local[MAX_REGISTER_HEAD_DIM];
    float *restrict acc = head_dim <= MAX_REGISTER_HEAD_DIM ? local : oh;
    for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.0f;
    for (int64_t first = 0, j = 0; first < len; first += block_size, j++) {
        const float *vb = v_cache + table[j] * block_floats + head_offset;
        const int64_t n = len - first < block_size ? len - first : block_size;
        for (int64_t t = 0; t < n; t++) {
            const float w = scores[first + t];
            const float *v = vb + t * row;
            for (int64_t d = 0; d < head_dim; d++) acc[d] += w * v[d];
        }
    }
    for (int64_t d = 0; d < head_dim; d++) oh[d] = acc[d] * inv;
}

/* q [B, H, D] (rows q_stride floats apart); caches [blocks, block_size, KVH, D]; tables
   [S, table_stride], row b reading table table_rows[b]; out [B, H, D]; scores: scratch of
   max(lengths) floats. */
int kvplane_paged_attention(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
    const int64_t *tables, int64_t table_stride, const int64_t *table_rows,
    const int64_t *lengths, float *out, float *scores, int64_t num_rows, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    const int64_t block_floats = block_size * row;
    for (int64_t b = 0; b < num_rows; b++) {
        const int64_t *table = tables + table_rows[b] * table_stride;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = q + b * q_stride + h * head_dim;
            float *oh = out + (b * num_heads + h) * head_dim;
            const int64_t offset = (h / group) * head_dim;
            if (head_dim == 64)
                attend_head(qh, k_cache, v_cache, table, lengths[b], block_size, row,
                            block_floats, offset, scale, scores, oh, 64);
            else if (head_dim == 128)
                attend_head(qh, k_cache, v_cache, table, lengths[b], block_size, row,
                            block_floats, offset, scale, scores, oh, 128);
            else
                attend_head(qh, k_cache, v_cache, table, lengths[b], block_size, row,
                            block_floats, offset, scale, scores, oh, head_dim);
        }
    }
    return 0;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of n floats. With `delta`,
   x[r] += delta[r] first, in place (the residual add). */
int kvplane_rms_norm(
    float *x, const float *delta, const float *weight, float *out, int64_t rows, int64_t n,
    float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        if (delta) {
            const float *dr = delta + r * n;
            for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
        }
        const float rstd = 1.0f / sqrtf(dot(xr, xr, n) / (float)n + eps);
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = (xr[i] * rstd) * weight[i];
    }
    return 0;
}

/* qkv [T, (H + 2 KVH) * D]: rotate the q and k heads of token t in place to positions[t]
   (rotate-half layout, full-width cos and signed sin tables [P, D]), then copy its k and v
   heads into slot slots[t] of the caches [slots, KVH, D]. */
int kvplane_rope_store(
    float *qkv, const int64_t *positions, const int64_t *slots, const float *cos_table,
    const float *sin_table, float *k_cache, float *v_cache, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
{
    const int64_t half = head_dim / 2;
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
    const int64_t kv_row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; t++) {
        float *row = qkv + t * width;
        const float *c = cos_table + positions[t] * head_dim;
        const float *s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            float *x = row + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] + b * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        memcpy(k_cache + slots[t] * kv_row, row + num_heads * head_dim, kv_row * sizeof(float));
        memcpy(v_cache + slots[t] * kv_row, row + (num_heads + num_kv_heads) * head_dim,
               kv_row * sizeof(float));
    }
    return 0;
}

/* gate_up [T, 2 I] -> out [T, I] = silu(gate) * up. */
int kvplane_silu_mul(
    const float *restrict gate_up, float *restrict out, int64_t num_tokens, int64_t inter)
{
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *g = gate_up + t * 2 * inter;
        const float *u = g + inter;
        float *o = out + t * inter;
        int64_t i = 0;
#ifdef __AVX__
        for (const __m256 one = _mm256_set1_ps(1.0f); i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
    }
    return 0;
}

"""

# -fno-trapping-math lets the compiler turn `fast_exp`'s clamps into vector selects (results
# unchanged: nothing here enables floating-point traps).
_FLAG_SETS = (("-O3", "-march=native", "-fno-trapping-math"), ("-O3", "-fno-trapping-math"))


class NativeKernels:
    """The compiled functions, each behind a wrapper that checks what the C code relies on
    (dtypes, contiguity, shapes) before it runs; a violation is a ValueError."""

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        signatures = {
            "kvplane_paged_attention": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr]
            + [i64] * 5
            + [f32],
            "kvplane_rms_norm": [ptr, ptr, ptr, ptr, i64, i64, f32],
            "kvplane_rope_store": [ptr] * 7 + [i64] * 4,
            "kvplane_silu_mul": [ptr, ptr, i64, i64],
        }
        for name, argtypes in signatures.items():
            fn = getattr(library, name)
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
        self._paged_attention = library.kvplane_paged_attention
        self._rms_norm = library.kvplane_rms_norm
        self._rope_store = library.kvplane_rope_store
        self._silu_mul = library.kvplane_silu_mul

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        block_tables: torch.Tensor,
        table_rows: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """query [B, H, D] (rows may be strided, e.g. a view of the fused q/k/v projection),
        caches [blocks, block_size, KVH, D], block_tables [S, max_blocks], table_rows [B] and
        lengths [B] int64 -> [B, H, D]: query b attends to positions 0 .. lengths[b] - 1 of
        the blocks in row table_rows[b] of block_tables (a decode: its context; a prefill token
        at position p: length p + 1, causal). Table rows, lengths and block ids are
        range-checked too (the C code indexes by them)."""
        num_rows, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        if not (
            query.dtype == key_cache.dtype == value_cache.dtype == torch.float32
            and block_tables.dtype == table_rows.dtype == lengths.dtype == torch.int64
            and query.stride(2) == 1
            and query.stride(1) == head_dim
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and block_tables.is_contiguous()
            and table_rows.is_contiguous()
            and lengths.is_contiguous()
            and query.device.type == key_cache.device.type == "cpu"
            and key_cache.shape[3] == head_dim
            and value_cache.shape == key_cache.shape
            and num_heads % num_kv_heads == 0
            and block_tables.dim() == 2
            and table_rows.shape == lengths.shape == (num_rows,)
        ):
            raise ValueError("paged_attention: float32 contiguous CPU tensors of matching shapes")
        if num_rows == 0:
            return query.new_empty(query.shape)
        shortest, longest = (int(x) for x in torch.aminmax(lengths))
        lowest, highest = (int(x) for x in torch.aminmax(block_tables))
        first, last = (int(x) for x in torch.aminmax(table_rows))
        if (
            shortest < 1
            or longest > block_tables.shape[1] * block_size
            or lowest < 0
            or highest >= key_cache.shape[0]
            or first < 0
            or last >= block_tables.shape[0]
        ):
            raise ValueError("paged_attention: a length, table row or block id is out of range")
        scratch = torch.empty(longest)  # one head's scores at a time: per call, no sharing
        out = query.new_empty(query.shape)
        self._paged_attention(
            query.data_ptr(),
            query.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            table_rows.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            num_rows,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
        )
        return out

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, n] -> RMSNorm(x) * weight, a new tensor. With `add`, `x += add` first, in place
        (the residual stream): one pass instead of an add and the norm's six torch ops."""
        rows, n = x.shape
        if not (
            x.dtype == weight.dtype == torch.float32
            and x.is_contiguous()
            and weight.is_contiguous()
            and weight.shape == (n,)
            and x.device.type == weight.device.type == "cpu"
            and (
                add is None
                or (add.dtype == torch.float32 and add.is_contiguous() and add.shape == x.shape)
            )
        ):
            raise ValueError("rms_norm: float32 contiguous CPU tensors of matching shapes")
        out = torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(),
            None if add is None else add.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            eps,
        )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        *,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_heads: int,
    ) -> None:
        """qkv [T, (H + 2 KVH) * D], the fused projection: rotates its q and k heads in place
        to `positions` (rotate-half layout; `cos`/`sin` [P, D] are full-width tables, the sine
        signed, as `model.apply_rotary` uses them: bit-identical arithmetic) and copies each
        token's k and v heads into slot `slots[t]` of the caches [blocks, block_size, KVH, D].
        Positions and slots are range-checked (the C code indexes by them)."""
        num_tokens, width = qkv.shape
        _, _, num_kv_heads, head_dim = key_cache.shape
        if not (
            qkv.dtype == cos.dtype == sin.dtype == key_cache.dtype == torch.float32
            and positions.dtype == slots.dtype == torch.int64
            and qkv.is_contiguous()
            and cos.is_contiguous()
            and sin.is_contiguous()
            and positions.is_contiguous()
            and slots.is_contiguous()
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and value_cache.shape == key_cache.shape
            and qkv.device.type == key_cache.device.type == "cpu"
            and width == (num_heads + 2 * num_kv_heads) * head_dim
            and head_dim % 2 == 0
            and cos.shape == sin.shape
            and cos.shape[1] == head_dim
            and positions.shape == slots.shape == (num_tokens,)
        ):
            raise ValueError("rope_store: float32 contiguous CPU tensors of matching shapes")
        if num_tokens == 0:
            return
        lowest, highest = (int(x) for x in torch.aminmax(positions))
        first, last = (int(x) for x in torch.aminmax(slots))
        capacity = key_cache.shape[0] * key_cache.shape[1]
        if lowest < 0 or highest >= cos.shape[0] or first < 0 or last >= capacity:
            raise ValueError("rope_store: a position or slot is out of range")
        self._rope_store(
            qkv.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 I] (the fused projection) -> silu(gate) * up [T, I]."""
        num_tokens, width = gate_up.shape
        if not (
            gate_up.dtype == torch.float32
            and gate_up.is_contiguous()
            and gate_up.device.type == "cpu"
            and width % 2 == 0
        ):
            raise ValueError("silu_mul: a float32 contiguous CPU tensor of even width")
        out = gate_up.new_empty((num_tokens, width // 2))
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), num_tokens, width // 2)
        return out


@functools.cache
def load_kernels() -> NativeKernels | None:
    """The compiled kernels, built on first use (once per process); None when unavailable."""
    try:
        with sigterm_unwinds():  # a compile stopped by SIGTERM removes its scratch folder
            built = _build()
        return NativeKernels(ctypes.CDLL(str(built)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native kernels unavailable, using torch: %s", exc)
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
    directory = cache_root() / "native"
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
        target = _cache_dir() / f"kernels_{key}.so"
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
            done = _compile(command)
            if done.returncode == 0:
                os.replace(built, target)  # atomic: concurrent builders agree
                return target
            errors.append(f"{' '.join(flags)}: {done.stderr.strip()[:300]}")
    raise RuntimeError("compiling the kernel failed: " + "; ".join(errors))


_COMPILE_TIMEOUT_S = 120


def _compile(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run the compiler to its end, and kill it with every process under it on any way out
    before then (SIGTERM's unwind, Ctrl-C, the timeout): the driver (`cc`) runs `cc1`, `as`
    and `ld` as children, and killing the driver alone, as `subprocess.run` does, leaves the
    one at work compiling on, an orphan. The compiler stays in this process's group, so a
    kill of the engine's whole group (`kvplane up` past `stop_timeout_s`) takes it too."""
    with subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as compiler:
        try:
            stdout, stderr = compiler.communicate(timeout=_COMPILE_TIMEOUT_S)
        except BaseException:
            _kill_tree(compiler.pid)
            raise
    return subprocess.CompletedProcess(command, compiler.returncode, stdout, stderr)


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants; stopped first, so that it starts no child between
    the listing and the kill."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    for member in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
