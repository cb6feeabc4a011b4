"""The Llama/Qwen2 decoder over a paged KV cache.

Both families share one forward: token embedding, then per layer RMSNorm -> grouped-query
attention with rotary position embeddings (rotate-half layout) -> residual -> RMSNorm -> SwiGLU
MLP -> residual, then a final RMSNorm and the LM head (the embedding matrix when tied). Qwen2
differs only in its q/k/v biases, which the loader passes in. q/k/v and gate/up projections are
stored fused (one matmul each), as in serving engines.

Numerics follow the reference implementation: RMSNorm is computed in float32 and cast back
before the weight multiply; cos/sin tables are computed in float32 and cast to the compute
dtype; logits are returned in float32 whatever the compute dtype.

LoRA: with a `LoraBatch`, each fused projection's output gets its rows' adapter deltas added in
place right after the base matmul (`engine.torch_runner.lora`), in both forwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.torch_runner.attention import (
    AttentionMetadata,
    PagedKvCache,
    paged_attention,
)
from engine.torch_runner.config import ModelConfig, RopeConfig, RopeType
from engine.torch_runner.errors import InvalidBatchError
from engine.torch_runner.lora import LoraBatch, Site
from engine.torch_runner.native import NativeKernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) in float32, cast back to x's dtype, times the weight (HF's
    order). Fused ops: in float32 one, in bfloat16 four (a GPU step pays per launch)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type is not RopeType.LLAMA3:
        return inv_freq
    # Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between them interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables indexed by position, grown on demand past max_position_embeddings."""

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._rope = rope
        self._inv_freq = rope_inverse_frequencies(rope, head_dim)
        self._dtype = dtype
        self._device = device
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._build(max_positions)

    def _build(self, num_positions: int) -> None:
        t = torch.arange(num_positions, dtype=torch.float32)
        if self._rope.type is RopeType.LINEAR:
            t = t / self._rope.factor
        freqs = torch.outer(t, self._inv_freq)
        cos = freqs.cos().to(self._dtype)
        sin = freqs.sin().to(self._dtype)
        # Full width, the sine signed for the first half: see `apply_rotary`.
        self._cos = torch.cat((cos, cos), dim=-1).to(self._device)
        self._sin = torch.cat((-sin, sin), dim=-1).to(self._device)

    def full_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [P, head_dim] for every position up to at least `max_position`."""
        if max_position >= self._cos.shape[0]:
            self._build(max(2 * self._cos.shape[0], max_position + 1))
        return self._cos, self._sin

    def tables(
        self, positions: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, signed sin of shape [T, 1, head_dim] for `apply_rotary`."""
        cos, sin = self.full_tables(max_position)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (GPT-NeoX) layout: pairs (i, i + D/2) rotate together,
    `(x1 cos - x2 sin, x2 cos + x1 sin)`, computed as `x * cos + swap_halves(x) * sin` with
    `cos = (cos, cos)` and `sin = (-sin, sin)` (bit-identical: a - b == a + (-b)); four ops
    instead of eight, once per layer and step."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # [(H + 2 * KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_attention_norm: torch.Tensor
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class ModelWeights:
    embed_tokens: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor | None  # the embedding itself when tied; None: pooling only
    classifier: torch.Tensor | None = None  # [num_labels, hidden]: a classifier's `score`


class DecoderModel:
    def __init__(
        self, config: ModelConfig, weights: ModelWeights, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.rotary = RotaryEmbedding(
            config.rope, config.head_dim, config.max_position_embeddings, dtype, device
        )
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim
        self._scale = config.head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: PagedKvCache,
        max_position: int,
        *,
        native: NativeKernels | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """[T] token ids -> [T, hidden] final hidden states (after the final norm).

        With `native` (float32 on CPU), `metadata` must be built with `kernel_rows` (and
        vice versa): the small per-layer ops run as native kernels (see `_native_forward`).
        """
        if native is not None:
            return self._native_forward(
                input_ids, metadata, kv_cache, max_position, native, lora=lora
            )
        cfg = self.config
        # Once per step, shared by every layer: rotary tables, the gather workspace's size.
        cos, sin = self.rotary.tables(metadata.positions, max_position)
        kv_cache.workspace.reserve(metadata.max_group_blocks)
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        hidden = F.embedding(input_ids, self.weights.embed_tokens)
        for index, layer in enumerate(self.weights.layers):
            residual = hidden
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            if lora is not None:
                lora.apply(index, Site.QKV, x, qkv)
            # q and k heads rotate together (one rotation, then views of its result).
            qk = qkv[:, : self._q_size + self._kv_size].view(-1, num_qk_heads, cfg.head_dim)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, self._q_size + self._kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention(
                q,
                k,
                v,
                key_cache=kv_cache.keys[index],
                value_cache=kv_cache.values[index],
                metadata=metadata,
                scale=self._scale,
                workspace=kv_cache.workspace,
            )
            o = F.linear(attn.flatten(1), layer.o_weight, layer.o_bias)
            if lora is not None:
                lora.apply(index, Site.O_PROJ, attn.flatten(1), o)
            hidden = residual + o
            residual = hidden
            x = rms_norm(hidden, layer.post_attention_norm, cfg.rms_norm_eps)
            gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
            if lora is not None:
                lora.apply(index, Site.GATE_UP, x, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)  # in place into silu's fresh output: one allocation
            down = F.linear(act, layer.down_weight, layer.down_bias)
            if lora is not None:
                lora.apply(index, Site.DOWN, act, down)
            hidden = residual + down
        return rms_norm(hidden, self.weights.final_norm, cfg.rms_norm_eps)

    def _native_forward(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: PagedKvCache,
        max_position: int,
        native: NativeKernels,
        *,
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        """The same forward with 4 matmuls and 4 native calls per layer instead of ~25 torch
        ops: RMSNorm fused with the residual add before it (the next layer's input norm, or the
        final norm, closes each layer), rotary in place on the fused q/k/v projection fused
        with the KV-cache write, SiLU x up in one pass, attention on the blocks in place.
        On tiny models each torch op's dispatch costs more than its arithmetic."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        cos, sin = self.rotary.full_tables(max_position)
        kv_cache.workspace.reserve(metadata.max_group_blocks)
        kv_heads = (cfg.num_kv_heads, cfg.head_dim)
        layers = self.weights.layers
        hidden = F.embedding(input_ids, self.weights.embed_tokens)  # the residual stream
        x = native.rms_norm(hidden, layers[0].input_norm, eps)
        for index, layer in enumerate(layers):
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            if lora is not None:
                lora.apply(index, Site.QKV, x, qkv)
            native.rope_store(
                qkv,
                positions=metadata.positions,
                slots=metadata.slot_mapping,
                cos=cos,
                sin=sin,
                key_cache=kv_cache.keys[index],
                value_cache=kv_cache.values[index],
                num_heads=cfg.num_heads,
            )
            q = qkv[:, : self._q_size].view(-1, cfg.num_heads, cfg.head_dim)
            k = v = None
            if metadata.fresh_prefills:  # only they read the step's keys and values here
                k = qkv[:, self._q_size : self._q_size + self._kv_size].view(-1, *kv_heads)
                v = qkv[:, self._q_size + self._kv_size :].view(-1, *kv_heads)
            attn = paged_attention(
                q,
                k,
                v,
                key_cache=kv_cache.keys[index],
                value_cache=kv_cache.values[index],
                metadata=metadata,
                scale=self._scale,
                workspace=kv_cache.workspace,
                kernel=native,
                stored=True,  # by rope_store
            )
            o = F.linear(attn.flatten(1), layer.o_weight, layer.o_bias)
            if lora is not None:
                lora.apply(index, Site.O_PROJ, attn.flatten(1), o)
            x = native.rms_norm(hidden, layer.post_attention_norm, eps, add=o)
            gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
            if lora is not None:
                lora.apply(index, Site.GATE_UP, x, gate_up)
            act = native.silu_mul(gate_up)
            down = F.linear(act, layer.down_weight, layer.down_bias)
            if lora is not None:
                lora.apply(index, Site.DOWN, act, down)
            next_norm = layers[index + 1].input_norm if index + 1 < len(layers) else None
            x = native.rms_norm(
                hidden, self.weights.final_norm if next_norm is None else next_norm, eps, add=down
            )
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        if self.weights.lm_head is None:
            raise InvalidBatchError("this model was loaded without an LM head (pooling only)")
        return F.linear(hidden, self.weights.lm_head).float()
