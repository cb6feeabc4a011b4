"""Embed, Classify and Score of the OpenEngine seed over a `Pooler` (the adapter ring).

Everything a request can get wrong is refused before acceptance with the domain errors of
`engine.server.errors` (the servicer's table makes them statuses): malformed input or an
unsupported explicit option -> INVALID_ARGUMENT, a task the model lacks (Classify without a
classification head) or a LoRA adapter -> FAILED_PRECONDITION, draining -> UNAVAILABLE, a
request id already running -> ALREADY_EXISTS, the engine's queue at `max_queued_requests` ->
RESOURCE_EXHAUSTED. Accepted, the task runs its inputs in batches
of at most `max_num_batched_tokens` tokens, each one engine-thread command between generation
steps (`EngineService.run_task`); an Abort of its request id or a drain's deadline stops it
(CANCELLED): a batch still waiting for the engine thread never runs, one already running
finishes unread. The client going away (or its deadline) stops it alike.

Semantics, following vLLM for a causal LM served for embeddings:
- Embed: the final hidden state of the pooled token (last by default), L2-normalised by
  default; `dimensions` keeps the first d values before normalising (Matryoshka); TOKEN
  granularity returns every token's row and the token ids.
- Score: the cosine similarity of the query's and each candidate's (normalised, full)
  embeddings, one value per candidate, higher is better; no normalisation choice but NONE
  (the cosine is the native value), no label-token scoring, no instruction.
- Classify: the checkpoint's head on the pooled state (every token's with TOKEN
  granularity), softmax probabilities by default (sigmoid for a one-label head), or logits,
  or log-probabilities; the labels are `id2label`'s.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from engine.core.errors import InvalidRequestError, PromptTooLongError
from engine.core.pooling import (
    Activation,
    PooledOutput,
    Pooler,
    PoolingParams,
    PoolingTask,
    plan_batches,
)
from engine.server.engine_service import EngineService, TaskHandle
from engine.server.errors import (
    FeatureDisabledError,
    ModelNotFoundError,
    NonFiniteOutputError,
    RequestAbortedError,
    UnsupportedOptionError,
)
from engine.server.openengine_convert import EngineContext
from kvplane.tokenize import tokenize_all_off_loop
from openengine.v1 import openengine_pb2 as pb

_SEQUENCE = pb.TASK_OUTPUT_GRANULARITY_SEQUENCE
_TOKEN = pb.TASK_OUTPUT_GRANULARITY_TOKEN
_SEMANTICS = {
    pb.TASK_VALUE_SEMANTICS_PROBABILITIES: Activation.PROBABILITIES,
    pb.TASK_VALUE_SEMANTICS_LOGITS: Activation.NONE,
    pb.TASK_VALUE_SEMANTICS_LOG_PROBABILITIES: Activation.LOG_PROBABILITIES,
}


@dataclass(frozen=True, slots=True)
class _Item:
    item_id: str
    token_ids: tuple[int, ...]


def _dense(output: PooledOutput) -> pb.DenseFloatTensor:
    return pb.DenseFloatTensor(shape=output.shape, values=output.values)


def _usage(items: Sequence[_Item]) -> pb.TaskUsage:
    # No prefix caching for pooling: every input token is computed.
    return pb.TaskUsage(
        input_tokens=sum(len(item.token_ids) for item in items), cached_input_tokens=0
    )


class PoolingTasks:
    """The three task RPCs' work, raising domain errors before acceptance."""

    def __init__(
        self, service: EngineService, ctx: EngineContext, pooler: Pooler, max_batched_tokens: int
    ) -> None:
        self._service = service
        self._ctx = ctx
        self._pooler = pooler
        self._max_batched_tokens = max_batched_tokens

    # ---------------------------------------------------------------- the RPCs

    async def embed(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        self._check_context(request.context)
        options = request.options
        granularity = self._granularity(options.granularity, "embed", (_SEQUENCE, _TOKEN))
        if options.encoding not in (pb.EMBEDDING_ENCODING_UNSPECIFIED, pb.EMBEDDING_ENCODING_DENSE):
            raise UnsupportedOptionError("only dense embeddings are supported")
        dimensions = options.dimensions if options.HasField("dimensions") else None
        if dimensions is not None and not 0 < dimensions <= self._pooler.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be in [1, {self._pooler.hidden_size}] (the model's own), "
                f"got {dimensions}"
            )
        params = PoolingParams(
            PoolingTask.EMBED,
            per_token=granularity == _TOKEN,
            normalize=options.normalize if options.HasField("normalize") else True,
            dimensions=dimensions,
        )
        with self._service.converting(request.context.request_id) as converted:
            items = await self._items(request.inputs)
        outputs = await self._accepted(converted, "embed", items, params)
        response = pb.EmbedResponse(request_id=request.context.request_id, usage=_usage(items))
        for index, (item, output) in enumerate(zip(items, outputs, strict=True)):
            embedding = pb.EmbeddingOutput(
                item_id=item.item_id,
                input_index=index,
                granularity=granularity,
                dense=_dense(output),
            )
            if params.per_token:
                embedding.token_ids.extend(item.token_ids)
            response.outputs.append(embedding)
        return response

    async def classify(self, request: pb.ClassifyRequest) -> pb.ClassifyResponse:
        self._check_context(request.context)
        labels = self._pooler.labels
        if labels is None:
            raise FeatureDisabledError(
                "classification needs a checkpoint with a classification head "
                "(*ForSequenceClassification); this model has none"
            )
        options = request.options
        granularity = self._granularity(options.granularity, "classify", (_SEQUENCE, _TOKEN))
        semantics = pb.TASK_VALUE_SEMANTICS_PROBABILITIES
        if options.HasField("output_semantics") and options.output_semantics:
            semantics = options.output_semantics
        if semantics not in _SEMANTICS:
            raise UnsupportedOptionError(
                "output_semantics must be PROBABILITIES, LOGITS or LOG_PROBABILITIES"
            )
        params = PoolingParams(
            PoolingTask.CLASSIFY, per_token=granularity == _TOKEN, activation=_SEMANTICS[semantics]
        )
        with self._service.converting(request.context.request_id) as converted:
            items = await self._items(request.inputs)
        outputs = await self._accepted(converted, "classify", items, params)
        response = pb.ClassifyResponse(request_id=request.context.request_id, usage=_usage(items))
        for index, (item, output) in enumerate(zip(items, outputs, strict=True)):
            result = pb.ClassificationOutput(
                item_id=item.item_id,
                input_index=index,
                granularity=granularity,
                semantics=semantics,
                scores=_dense(output),
                labels=labels,
            )
            if params.per_token:
                result.token_ids.extend(item.token_ids)
            response.outputs.append(result)
        return response

    async def score(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        self._check_context(request.context)
        options = request.options
        self._granularity(options.granularity, "score", (_SEQUENCE,))
        if options.output_semantics not in (
            pb.TASK_VALUE_SEMANTICS_UNSPECIFIED,
            pb.TASK_VALUE_SEMANTICS_SIMILARITY,
        ):
            raise UnsupportedOptionError("score output_semantics: only SIMILARITY (cosine)")
        if options.normalization not in (
            pb.SCORE_NORMALIZATION_UNSPECIFIED,
            pb.SCORE_NORMALIZATION_NONE,
        ):
            raise UnsupportedOptionError("score normalization: only NONE (the cosine itself)")
        if options.label_token_ids:
            raise UnsupportedOptionError("label-token scoring is not supported")
        if options.instruction:
            raise UnsupportedOptionError("score instructions are not supported")
        if not request.groups:
            raise InvalidRequestError("groups must not be empty")
        if len({g.group_id for g in request.groups}) != len(request.groups):
            raise InvalidRequestError("group ids must be unique")
        given: list[tuple[pb.TaskInput, str]] = []
        for index, group in enumerate(request.groups):
            if not group.HasField("query"):
                raise InvalidRequestError(f"groups[{index}] has no query")
            members = [group.query, *group.candidates]
            given.extend(self._placed(members, f"groups[{index}]", min_items=2))
        with self._service.converting(request.context.request_id) as converted:
            # Every group's texts tokenised in one call (`_tokenized`).
            tokenized = iter(await self._tokenized(given))
        groups: list[tuple[_Item, list[_Item]]] = []
        for group in request.groups:
            query = next(tokenized)
            groups.append((query, [next(tokenized) for _ in group.candidates]))
        # Each distinct token sequence is embedded once (a query shared by N:N groups).
        distinct = list(
            dict.fromkeys(item.token_ids for q, cs in groups for item in (q, *cs)).keys()
        )
        params = PoolingParams(PoolingTask.EMBED, normalize=True)
        vectors = await self._accepted(converted, "score", [_Item("", t) for t in distinct], params)
        by_tokens = {t: v.values for t, v in zip(distinct, vectors, strict=True)}
        response = pb.ScoreResponse(
            request_id=request.context.request_id,
            granularity=_SEQUENCE,
            semantics=pb.TASK_VALUE_SEMANTICS_SIMILARITY,
            higher_is_better=True,
            normalization=pb.SCORE_NORMALIZATION_NONE,
            usage=_usage([item for q, cs in groups for item in (q, *cs)]),
        )
        for group_index, (group, (query, candidates)) in enumerate(
            zip(request.groups, groups, strict=True)
        ):
            out = response.groups.add(group_id=group.group_id, group_index=group_index)
            q = by_tokens[query.token_ids]
            for candidate_index, candidate in enumerate(candidates):
                cosine = sum(map(operator.mul, q, by_tokens[candidate.token_ids]))
                out.candidates.add(
                    candidate_id=candidate.item_id,
                    candidate_index=candidate_index,
                    scores=pb.DenseFloatTensor(shape=[1], values=[cosine]),
                )
        return response

    # ---------------------------------------------------------------- validation

    def _check_context(self, context: pb.TaskRequestContext) -> None:
        # request_id and model (required by the seed) and the model were checked first.
        if context.lora_name:
            raise FeatureDisabledError("LoRA adapters are not supported for pooling tasks")
        if context.HasField("priority"):
            raise UnsupportedOptionError("priority is not supported for pooling tasks")

    @staticmethod
    def _granularity(
        value: pb.TaskOutputGranularity.ValueType,
        task: str,
        supported: tuple[pb.TaskOutputGranularity.ValueType, ...],
    ) -> pb.TaskOutputGranularity.ValueType:
        if value == pb.TASK_OUTPUT_GRANULARITY_UNSPECIFIED:
            return _SEQUENCE
        if value not in supported:
            names = ", ".join(pb.TaskOutputGranularity.Name(g) for g in supported)
            raise UnsupportedOptionError(f"{task} granularity: one of {names}")
        return value

    async def _items(self, inputs: Sequence[pb.TaskInput]) -> list[_Item]:
        return await self._tokenized(self._placed(inputs, "inputs"))

    @staticmethod
    def _placed(
        inputs: Sequence[pb.TaskInput], where: str, *, min_items: int = 1
    ) -> list[tuple[pb.TaskInput, str]]:
        """`inputs`, found at `where` in the request, each with its place there (for a
        refusal); refused when fewer than `min_items` or of one item id twice."""
        if len(inputs) < min_items:
            raise InvalidRequestError(
                f"{where}: a query and at least one candidate are needed"
                if min_items > 1
                else f"{where} must not be empty"
            )
        ids = [item.item_id for item in inputs if item.item_id]  # (none: `_given` refuses it)
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"{where}: item ids must be unique")
        return [(item, f"{where}[{i}]") for i, item in enumerate(inputs)]

    async def _tokenized(self, placed: Sequence[tuple[pb.TaskInput, str]]) -> list[_Item]:
        """Each input of `placed` (with its place in the request) as its tokens, checked: all
        of a request's texts tokenised in one call, in a worker thread when they are long
        together (`tokenize_all_off_loop`: a batch of many short texts would stall the event
        loop, every stream and Health, as one long text would)."""
        given = [self._given(item, where) for item, where in placed]
        texts = [g for g in given if isinstance(g, str)]
        encoded: Iterator[list[int]] = iter(())
        if texts:
            encode = self._ctx.encode
            assert encode is not None  # (`_given` refuses text without a tokenizer)
            encoded = iter(await tokenize_all_off_loop(encode, texts))
        return [
            self._item(item.item_id, g if isinstance(g, tuple) else tuple(next(encoded)), where)
            for (item, where), g in zip(placed, given, strict=True)
        ]

    def _given(self, item: pb.TaskInput, where: str) -> str | tuple[int, ...]:
        """The text or token ids `item`, at `where`, gives."""
        if not item.item_id:
            raise InvalidRequestError(f"{where}: item_id is required")
        which = item.WhichOneof("input")
        if which == "token_ids":
            return tuple(item.token_ids.ids)
        if which == "text":
            if self._ctx.encode is None:
                raise UnsupportedOptionError("this engine has no tokenizer: send token_ids")
            return item.text
        if which == "multimodal":
            raise UnsupportedOptionError("multimodal inputs are not supported by this engine")
        raise InvalidRequestError(f"{where}: set text or token_ids")

    def _item(self, item_id: str, tokens: tuple[int, ...], where: str) -> _Item:
        if not tokens:
            raise InvalidRequestError(f"{where} is empty (no tokens)")
        model = self._ctx.model
        if len(tokens) > model.max_model_len:
            raise PromptTooLongError(
                f"{where} has {len(tokens)} tokens, more than max_model_len {model.max_model_len}"
            )
        if max(tokens) >= model.vocab_size:
            raise InvalidRequestError(
                f"{where}: token id {max(tokens)} >= vocab size {model.vocab_size}"
            )
        return _Item(item_id, tokens)

    # ---------------------------------------------------------------- running

    async def _accepted(
        self, converted: TaskHandle, task: str, items: Sequence[_Item], params: PoolingParams
    ) -> list[PooledOutput]:
        """Accept (the last refusals: draining, a duplicate id, overload) and run every
        batch; `converted`: the request's hold while its inputs were tokenised
        (`EngineService.converting`), which an Abort meanwhile ends CANCELLED unrun."""
        if converted.aborted.is_set():
            raise RequestAbortedError(f"request {converted.request_id!r} was aborted")
        handle = self._service.begin_task(converted.request_id, task)
        if self._service.metrics is not None:
            self._service.metrics.on_task(task, sum(len(item.token_ids) for item in items))
        try:
            return await self._run(handle, task, [item.token_ids for item in items], params)
        finally:
            self._service.end_task(handle)

    async def _run(
        self,
        handle: TaskHandle,
        task: str,
        inputs: list[tuple[int, ...]],
        params: PoolingParams,
    ) -> list[PooledOutput]:
        outputs: list[PooledOutput] = []
        lengths = [len(tokens) for tokens in inputs]
        pooler = self._pooler
        metrics = self._service.metrics
        for batch in plan_batches(lengths, self._max_batched_tokens):
            chunk = [inputs[i] for i in batch]

            def pool(_core: object, chunk: list[tuple[int, ...]] = chunk) -> list[PooledOutput]:
                pooled = pooler.pool(chunk, params)
                # Counted where it ran: a batch whose task was aborted meanwhile computed too.
                if metrics is not None:
                    metrics.on_pooling_forward(task, sum(map(len, chunk)))
                return pooled

            for output in await self._service.run_task(handle, pool):
                # The values are float32: a float64 sum of finite ones cannot overflow, so a
                # non-finite sum means a NaN or an infinity among them.
                if not math.isfinite(sum(output.values)):
                    raise NonFiniteOutputError(
                        f"the model produced a non-finite value (NaN or infinity) for input "
                        f"{len(outputs)}; a task's tensors must be finite"
                    )
                outputs.append(output)
        return outputs


def check_task_context(context: pb.TaskRequestContext, ctx: EngineContext) -> None:
    """The seed: request_id and model are required and non-empty (INVALID_ARGUMENT, whatever
    the task's support), then the model must be served here (NOT_FOUND)."""
    if not context.request_id or not context.model:
        raise InvalidRequestError("context.request_id and context.model are required")
    if not ctx.model.serves(context.model):
        raise ModelNotFoundError(f"model {context.model!r} is not served here")
