"""TorchModelRunner: the engine core's `ModelRunner` over a real torch decoder.

One `execute(batch)` is one forward pass over every scheduled sequence's new tokens (prefill
chunks and decodes mixed), then logits only for the rows that need them (each sampling
sequence's last token, plus the prompt positions whose logprobs were asked for), then sampling.
It is synchronous and holds no locks: the engine drives it from one dedicated thread.

Block ids in the scheduled block tables are the block manager's; this runner only owns the
memory behind them (`PagedKvCache`). It keeps no per-sequence state (seeded sampling derives
each step's generator from the seed and the output length), so `release` has nothing to free.

LoRA (`engine.core.lora.LoraRunner`): adapters read by `read_lora` (any thread) are served
under their slots' keys (one per load) once `add_lora` runs (the engine thread, between
steps); each step applies every sequence's adapter to its own rows
(`engine.torch_runner.lora.LoraBatch`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.core.api import (
    KvBlockBytes,
    ScheduledBatch,
    ScheduledSequence,
    SequenceResult,
    TokenLogprob,
)
from engine.torch_runner.attention import (
    AttentionMetadata,
    PagedKvCache,
    SequenceChunk,
    int64_tensor,
    sdpa_backends,
)
from engine.torch_runner.errors import InvalidBatchError, KvCacheError
from engine.torch_runner.loader import load_model
from engine.torch_runner.lora import LoraBatch, LoraWeights, read_lora
from engine.torch_runner.model import DecoderModel
from engine.torch_runner.native import NativeKernels, load_kernels
from engine.torch_runner.sampler import Sampler, SamplingRow, plain_greedy, prompt_logprobs

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024


class TorchModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        *,
        block_size: int,
        num_blocks: int,
        max_model_len: int | None = None,
        seed: int | None = None,
        num_threads: int | None = None,
        native_kernels: bool | None = None,
    ) -> None:
        """`native_kernels`: run decode attention (on the paged blocks in place) and the small
        per-layer ops with the native kernels (`native.py`). None: when torch runs on one
        intra-op thread (the kernels are single-threaded; with more, torch parallelises), the
        model is float32 on CPU and the kernels build; True: always (KvCacheError if they
        cannot); False: never (torch ops throughout, the blocks gathered)."""
        if num_threads is not None:
            # Process-wide: the engine process owns torch. Small decode steps of small models
            # run fastest on one thread; OpenMP barriers on oversubscribed cores cost 10x.
            torch.set_num_threads(num_threads)
        cfg = model.config
        self.model = model
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._max_model_len = max_model_len or cfg.max_position_embeddings
        if self._max_model_len <= 0:
            raise KvCacheError(f"max_model_len must be positive, got {self._max_model_len}")
        if self._max_model_len > cfg.max_position_embeddings:
            # As vLLM refuses it: positions past what the model was trained on give garbage.
            raise KvCacheError(
                f"max_model_len {self._max_model_len} is beyond the model's "
                f"max_position_embeddings {cfg.max_position_embeddings}"
            )
        self._eos_token_ids = frozenset(cfg.eos_token_ids)
        self.kv_cache = PagedKvCache(
            num_layers=cfg.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=model.dtype,
            device=model.device,
        )
        self.sampler = Sampler(self._eos_token_ids, seed)
        self.native_kernels: NativeKernels | None = None
        wanted = native_kernels or (native_kernels is None and torch.get_num_threads() == 1)
        if wanted and model.dtype == torch.float32 and model.device.type == "cpu":
            self.native_kernels = load_kernels()
        if native_kernels and self.native_kernels is None:
            raise KvCacheError(
                "the native kernels are not available here (they need float32 on CPU and a C "
                "compiler)"
            )
        self._loras: dict[str, LoraWeights] = {}
        element_bytes = torch.empty((), dtype=model.dtype).element_size()
        self._key_bytes = cfg.num_kv_heads * cfg.head_dim * element_bytes

    @classmethod
    def from_pretrained(
        cls,
        model_dir: Path | str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        seed: int | None = None,
        num_threads: int | None = None,
        native_kernels: bool | None = None,
        with_lm_head: bool = True,
    ) -> TorchModelRunner:
        """Load a checkpoint and size the KV cache by `num_blocks` or by `kv_cache_bytes`.
        `with_lm_head=False`: no LM head (a pooling-only engine: `execute` cannot sample)."""
        if num_blocks is not None and kv_cache_bytes is not None:
            raise KvCacheError("give num_blocks or kv_cache_bytes, not both")
        if block_size <= 0:
            raise KvCacheError(f"block_size must be positive, got {block_size}")
        model = load_model(model_dir, dtype, device, with_lm_head=with_lm_head)
        if num_blocks is None:
            cfg = model.config
            per_block = PagedKvCache.bytes_per_block(
                num_layers=cfg.num_layers,
                block_size=block_size,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                dtype=model.dtype,
            )
            budget = DEFAULT_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes
            num_blocks = budget // per_block
            if num_blocks < 1:
                raise KvCacheError(
                    f"kv_cache_bytes {budget} holds no block ({per_block} bytes per block)"
                )
        logger.info(
            "loaded %s (%s, %s) with %d KV blocks of %d tokens",
            model_dir,
            dtype,
            device,
            num_blocks,
            block_size,
        )
        return cls(
            model,
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            seed=seed,
            num_threads=num_threads,
            native_kernels=native_kernels,
        )

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Token ids at or above this are invalid (check prompts before accepting them)."""
        return self.model.config.vocab_size

    # ---------------------------------------------------------------- LoRA

    def read_lora(self, path: Path, *, max_rank: int) -> LoraWeights:
        return read_lora(
            path, self.model.config, self.model.dtype, self.model.device, max_rank=max_rank
        )

    def add_lora(self, key: str, weights: object) -> None:
        if not isinstance(weights, LoraWeights):
            raise TypeError("add_lora takes what read_lora returned")
        self._loras[key] = weights

    def remove_lora(self, key: str) -> None:
        self._loras.pop(key, None)

    @property
    def kv_layout(self) -> str:
        return self.kv_cache.layout

    @property
    def kv_block_bytes(self) -> int:
        return self.kv_cache.block_bytes

    def read_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        return self.kv_cache.read_blocks(block_ids)

    def write_kv_blocks(self, block_ids: Sequence[int], blocks: Sequence[KvBlockBytes]) -> None:
        self.kv_cache.write_blocks(block_ids, blocks)

    def execute(self, batch: ScheduledBatch) -> list[SequenceResult]:
        sequences = batch.sequences
        if not sequences:
            return []
        with torch.inference_mode(), sdpa_backends(self.model.device):
            return self._execute(sequences)

    def _execute(self, sequences: Sequence[ScheduledSequence]) -> list[SequenceResult]:
        model = self.model
        device = model.device
        input_ids = [t for seq in sequences for t in seq.token_ids]
        chunks = [
            SequenceChunk(seq.start_position, len(seq.token_ids), seq.block_table)
            for seq in sequences
        ]
        max_position = max(c.start + c.num_tokens for c in chunks) - 1
        self._check(input_ids, max_position)
        metadata = AttentionMetadata.build(
            chunks,
            block_size=self._block_size,
            num_blocks=self._num_blocks,
            device=device,
            dtype=model.dtype,
            key_bytes=self._key_bytes,
            kernel_rows=self.native_kernels is not None,
        )
        ids = int64_tensor(input_ids, device)
        lora = LoraBatch.build(sequences, self._loras, device)
        hidden = model.forward(
            ids, metadata, self.kv_cache, max_position, native=self.native_kernels, lora=lora
        )
        plan = _LogitRows.plan(sequences)
        if not plan.rows:
            return [SequenceResult(seq_id=seq.seq_id) for seq in sequences]
        # Rows are increasing: as many as the tokens means every token (a decode-only step).
        if len(plan.rows) != len(input_ids):
            hidden = hidden[torch.tensor(plan.rows, dtype=torch.int64, device=device)]
        logits = model.compute_logits(hidden)
        sampling_seqs = [seq for seq in sequences if seq.sample]
        sample_logits = logits
        if len(plan.sample_rows) != len(plan.rows):
            sample_logits = logits[torch.tensor(plan.sample_rows, dtype=torch.int64, device=device)]
        tokens: list[int] = []
        token_logprobs: list[TokenLogprob | None] = []
        if all(
            plain_greedy(seq.sampling, len(seq.output_token_ids)) and seq.allowed_token_ids is None
            for seq in sampling_seqs
        ):
            # What the sampler computes for such rows, without a row object per sequence.
            tokens = sample_logits.argmax(dim=-1).tolist() if sampling_seqs else []
            token_logprobs = [None] * len(tokens)
        else:
            for token in self.sampler.sample(
                sample_logits,
                [
                    SamplingRow(
                        params=seq.sampling,
                        seed=seq.seed,
                        prompt_token_ids=seq.prompt_token_ids,
                        output_token_ids=seq.output_token_ids,
                        allowed_token_ids=seq.allowed_token_ids,
                    )
                    for seq in sampling_seqs
                ],
            ):
                tokens.append(token.token_id)
                token_logprobs.append(token.logprob)
        results: list[SequenceResult] = []
        sampled = 0
        for i, seq in enumerate(sequences):
            prompt: tuple[TokenLogprob, ...] = ()
            if i in plan.prompt_rows and seq.prompt_logprobs is not None:
                first, targets = plan.prompt_rows[i]
                window = logits[first : first + len(targets)]
                prompt = prompt_logprobs(window, targets, seq.prompt_logprobs)
            if seq.sample:
                result = SequenceResult(
                    seq_id=seq.seq_id,
                    token_id=tokens[sampled],
                    logprob=token_logprobs[sampled],
                    prompt_logprobs=prompt,
                )
                sampled += 1
            else:
                result = SequenceResult(seq_id=seq.seq_id, prompt_logprobs=prompt)
            results.append(result)
        return results

    def _check(self, input_ids: list[int], max_position: int) -> None:
        if max_position >= self._max_model_len:
            raise InvalidBatchError(
                f"position {max_position} is beyond max_model_len {self._max_model_len}"
            )
        vocab = self.model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise InvalidBatchError(f"a token id is outside the vocabulary [0, {vocab})")


@dataclass(slots=True)
class _LogitRows:
    """Which rows of the step's hidden states need logits, and what each is for."""

    rows: list[int] = field(default_factory=list)  # indices into the flat tokens
    # sequence index -> (first of its rows in `rows`, the prompt tokens those rows score)
    prompt_rows: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    sample_rows: list[int] = field(default_factory=list)  # indices into `rows`

    @classmethod
    def plan(cls, sequences: Sequence[ScheduledSequence]) -> _LogitRows:
        plan = cls()
        offset = 0
        for i, seq in enumerate(sequences):
            num_tokens = len(seq.token_ids)
            if seq.prompt_logprobs is not None:
                # Position q scores prompt token q + 1, up to the last prompt token.
                start = seq.start_position
                end = min(start + num_tokens, len(seq.prompt_token_ids) - 1)
                if end > start:
                    targets = list(seq.prompt_token_ids[start + 1 : end + 1])
                    plan.prompt_rows[i] = (len(plan.rows), targets)
                    plan.rows.extend(range(offset, offset + end - start))
            if seq.sample:
                plan.sample_rows.append(len(plan.rows))
                plan.rows.append(offset + num_tokens - 1)
            offset += num_tokens
        return plan
