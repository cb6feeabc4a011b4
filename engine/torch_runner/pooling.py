"""Pooling (embed, classify) over the torch runner's model: one forward without the KV cache.

`TorchPooler.pool(inputs, params)` runs every input through the decoder in one forward pass
(each input attends causally to its own tokens only), takes the final hidden states (after
the final norm, before the LM head), pools them per input (`PoolingType`: the last token by
default, as vLLM pools a causal LM; or the mean, or the first token) or keeps every token,
then embeds (Matryoshka truncation to `dimensions`, then L2 normalisation) or classifies (the
checkpoint's `score` head, then softmax probabilities; sigmoid for a one-label head, as vLLM).

The engine's paged KV cache and block manager are never touched: the forward runs on a
private scratch cache of ONE layer that every layer shares. That is sound because a pooling
forward is complete (no chunk, no earlier context): layer i writes its keys and values and
attends to them before layer i + 1 overwrites them. So the pooling forward is the very
forward generation runs (the same kernels and numerics: paged groups or the native kernel),
and it holds one layer's keys and values, as a dense forward would, not a cache's worth.

Called on the engine thread only (`EngineLoop.call`): the scratch cache and the model's
rotary tables are shared with generation steps, which run on that thread too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.core.pooling import Activation, PooledOutput, PoolingParams, PoolingTask, PoolingType
from engine.torch_runner.attention import (
    AttentionMetadata,
    PagedKvCache,
    SequenceChunk,
    int64_tensor,
    sdpa_backends,
)
from engine.torch_runner.errors import CheckpointError, InvalidBatchError
from engine.torch_runner.runner import TorchModelRunner

# sentence-transformers' Pooling module modes (its `1_Pooling/config.json`) that we run.
_SENTENCE_TRANSFORMERS_MODES = {
    "pooling_mode_lasttoken": PoolingType.LAST,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
}


def pooling_type_for(model_dir: Path) -> PoolingType:
    """The checkpoint's pooling: its sentence-transformers Pooling module when it ships one
    (`modules.json`, as vLLM reads it), else LAST. A mode we do not run (max, weighted mean,
    several at once) is refused rather than replaced."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolingType.LAST
    try:
        modules = json.loads(modules_file.read_text())
        pooling = next(
            (m for m in modules if m.get("type") == "sentence_transformers.models.Pooling"), None
        )
        if pooling is None:
            return PoolingType.LAST
        config = json.loads((model_dir / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise CheckpointError(
            f"cannot read the sentence-transformers pooling config: {exc}"
        ) from exc
    modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(modes) != 1 or modes[0] not in _SENTENCE_TRANSFORMERS_MODES:
        raise CheckpointError(
            f"sentence-transformers pooling {modes} is not supported; one of "
            f"{sorted(_SENTENCE_TRANSFORMERS_MODES)}"
        )
    return _SENTENCE_TRANSFORMERS_MODES[modes[0]]


class TorchPooler:
    """The `engine.core.pooling.Pooler` of a `TorchModelRunner`."""

    def __init__(self, runner: TorchModelRunner, pooling_type: PoolingType) -> None:
        self._runner = runner
        self._pooling_type = pooling_type
        self._scratch: PagedKvCache | None = None

    @classmethod
    def for_model_dir(cls, runner: TorchModelRunner, model_dir: Path) -> TorchPooler:
        return cls(runner, pooling_type_for(model_dir))

    @property
    def hidden_size(self) -> int:
        return self._runner.model.config.hidden_size

    @property
    def labels(self) -> tuple[str, ...] | None:
        return self._runner.model.config.classifier_labels

    @property
    def pooling_type(self) -> PoolingType:
        return self._pooling_type

    def pool(self, inputs: Sequence[Sequence[int]], params: PoolingParams) -> list[PooledOutput]:
        if not inputs or min(len(tokens) for tokens in inputs) == 0:
            raise InvalidBatchError("pooling needs at least one input of at least one token")
        model = self._runner.model
        with torch.inference_mode(), sdpa_backends(model.device):
            hidden = self._forward(inputs)
            lengths = [len(tokens) for tokens in inputs]
            rows = hidden if params.per_token else self._pooled(hidden, lengths)
            if params.task is PoolingTask.EMBED:
                values = rows.float()
                if params.dimensions is not None:
                    values = values[:, : params.dimensions]
                if params.normalize:
                    values = F.normalize(values, p=2.0, dim=-1)
            else:
                values = self._classify(rows.to(model.dtype), params.activation)
            values = values.cpu()
        pieces = values.split_with_sizes(lengths) if params.per_token else values.unbind(0)
        return [PooledOutput(tuple(piece.shape), piece.reshape(-1).tolist()) for piece in pieces]

    def _forward(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[T, hidden] final hidden states of every token of every input, in input order."""
        runner, model = self._runner, self._runner.model
        block_size = runner.block_size
        vocab = model.config.vocab_size
        longest = max(len(tokens) for tokens in inputs)
        if longest > runner.max_model_len:
            raise InvalidBatchError(f"an input is beyond max_model_len {runner.max_model_len}")
        flat = [t for tokens in inputs for t in tokens]
        if min(flat) < 0 or max(flat) >= vocab:
            raise InvalidBatchError(f"a token id is outside the vocabulary [0, {vocab})")
        chunks: list[SequenceChunk] = []
        next_block = 0
        for tokens in inputs:  # each input on consecutive blocks of the scratch cache
            num_blocks = -(-len(tokens) // block_size)
            chunks.append(
                SequenceChunk(0, len(tokens), list(range(next_block, next_block + num_blocks)))
            )
            next_block += num_blocks
        cache = self._scratch_cache(next_block)
        cfg = model.config
        key_bytes = cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=model.dtype).itemsize
        native = runner.native_kernels
        metadata = AttentionMetadata.build(
            chunks,
            block_size=block_size,
            num_blocks=cache.num_blocks,
            device=model.device,
            dtype=model.dtype,
            key_bytes=key_bytes,
            kernel_rows=native is not None,
        )
        ids = int64_tensor(flat, model.device)
        return model.forward(ids, metadata, cache, longest - 1, native=native)

    def _scratch_cache(self, num_blocks: int) -> PagedKvCache:
        """One layer's blocks, aliased by every layer (see the module docstring); kept and
        grown to the largest batch seen."""
        if self._scratch is None or self._scratch.num_blocks < num_blocks:
            model = self._runner.model
            cfg = model.config
            cache = PagedKvCache(
                num_layers=1,
                num_blocks=num_blocks,
                block_size=self._runner.block_size,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                dtype=model.dtype,
                device=model.device,
            )
            cache.keys = cache.keys * cfg.num_layers
            cache.values = cache.values * cfg.num_layers
            self._scratch = cache
        return self._scratch

    def _pooled(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """[T, hidden] -> [inputs, hidden], per `pooling_type`."""
        if self._pooling_type is PoolingType.MEAN:
            pieces = hidden.split_with_sizes(lengths)
            return torch.stack([piece.float().mean(dim=0) for piece in pieces])
        ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        if self._pooling_type is PoolingType.LAST:
            rows = ends - 1
        else:  # CLS: the first token
            rows = ends - torch.tensor(lengths, dtype=torch.int64)
        return hidden.index_select(0, rows.to(hidden.device))

    def _classify(self, rows: torch.Tensor, activation: Activation) -> torch.Tensor:
        head = self._runner.model.weights.classifier
        if head is None:
            raise InvalidBatchError("this model has no classification head")
        logits = F.linear(rows, head).float()
        if activation is Activation.NONE:
            return logits
        one_label = head.shape[0] == 1  # a score, not a distribution: sigmoid (vLLM's)
        if activation is Activation.PROBABILITIES:
            return logits.sigmoid() if one_label else logits.softmax(dim=-1)
        return F.logsigmoid(logits) if one_label else logits.log_softmax(dim=-1)
