"""What the engine says about itself: EngineInfo, ModelInfo, KvConnectorInfo, LoadInfo.

Capabilities advertise exactly what this engine implements: a capability it has is `true`
with its limits, one it lacks is an explicit `false` (never absent), and a value it cannot
measure is left absent (proto3 presence). `ServedModel.check_request` holds every request to
the vocabulary limits advertised here, for both front ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.api import EngineRequest, LoadSnapshot
from engine.core.errors import InvalidRequestError
from engine.server.kv_transfer import PROTOCOL, TRANSFER_BACKEND
from kvplane import __version__
from openengine.v1 import openengine_pb2 as pb

ENGINE_NAME = "kvplane"
SCHEMA_REVISION = 1
MINIMUM_CLIENT_REVISION = 1
# Immutable tag of the OpenEngine text this engine implements: revision 1 as given in the
# seed document 000_94b72b7dabd1ee94 (never a moving branch name).
SCHEMA_RELEASE = "openengine-v1-r1+seed.94b72b7dabd1ee94"

# Why a pooling-only engine refuses generation (FAILED_PRECONDITION, both front ends).
POOLING_ONLY_MESSAGE = (
    "this engine serves Embed, Classify and Score only (runner: pooling): it does not generate"
)
# Why an engine run without LoRA refuses an adapter (FAILED_PRECONDITION), and how to have it.
LORA_DISABLED_MESSAGE = "LoRA is not enabled on this engine (start it with lora.enabled: true)"

_ALL_MODES = [
    pb.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N,
    pb.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS,
    pb.CANDIDATE_TOKEN_SELECTION_MODE_ALL,
]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The one model this engine serves, with the limits its clients need."""

    model_id: str  # `sim` or the model directory
    name: str
    aliases: tuple[str, ...]
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_batched_tokens: int
    vocab_size: int
    has_tokenizer: bool
    # Pooling tasks (a torch model): the embedding dimension (None: no embed/score), the
    # classification head's labels (None: no head, no classify).
    embedding_dimension: int | None = None
    classifier_labels: tuple[str, ...] | None = None
    supports_lora: bool = False
    # False: a pooling-only engine (`runner: pooling`): no Generate, no KV cache to speak of.
    generates: bool = True

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    @property
    def max_context_length(self) -> int:
        """The longest sequence (prompt and outputs) it can hold: the model's length, or the
        KV cache's when that is smaller, one token more than the cache's slots (the last token
        is sampled, never computed: `EngineCore.check_request`). A pooling-only engine's
        inputs never enter its KV cache: the model's length."""
        if not self.generates:
            return self.max_model_len
        return min(self.max_model_len, self.num_blocks * self.block_size + 1)

    @property
    def max_top_n(self) -> int:
        """Candidates per position, advertised in ModelInfo: the whole vocabulary at most."""
        return self.vocab_size

    def serves(self, requested: str) -> bool:
        """Empty means the default (only) model."""
        return not requested or requested in self.names

    def check_request(self, request: EngineRequest) -> None:
        """Refuse (InvalidRequestError) what exceeds this model's advertised limits: a token id
        outside the vocabulary (prompt, stop ids, candidate ids, logit bias, allowed ids) or top_n
        above max_top_n.

        The engine core knows no vocabulary, so both front ends call this before submitting.
        """
        sampling = request.sampling
        self._check_token_ids(request.prompt_token_ids, "prompt")
        self._check_token_ids(sampling.stop_token_ids, "stop token ids")
        self._check_token_ids([t for t, _ in sampling.logit_bias], "logit_bias")
        self._check_token_ids(sampling.allowed_token_ids or (), "allowed_token_ids")
        for logprobs, what in (
            (sampling.prompt_logprobs, "prompt candidates"),
            (sampling.logprobs, "output candidates"),
        ):
            if logprobs is None:
                continue
            self._check_token_ids(logprobs.token_ids, what)
            if logprobs.top_n > self.max_top_n:
                raise InvalidRequestError(
                    f"{what}: top_n {logprobs.top_n} is more than max_top_n {self.max_top_n}"
                )

    def _check_token_ids(self, ids: Sequence[int], what: str) -> None:
        largest = max(ids, default=-1)
        if largest >= self.vocab_size:
            raise InvalidRequestError(f"{what}: token id {largest} >= vocab size {self.vocab_size}")


def engine_info(
    model: ServedModel,
    *,
    role: pb.EngineRole.ValueType,
    instance_id: str,
    data_parallel_rank: int,
    kv_connector: pb.KvConnectorInfo,
) -> pb.EngineInfo:
    """What GetEngineInfo tells. The engine is one data-parallel rank (`data_parallel_rank`,
    `kv_events.data_parallel_rank`): rank 0 is taken for a lone engine, a group of 1; above
    0 it is one rank of a group whose size it is not told, so `data_parallel_size` is left
    absent (the seed: not reported), never 1, which no rank above 0 is within."""
    parallelism = pb.ParallelismInfo(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_rank=data_parallel_rank,
        data_parallel_start_rank=data_parallel_rank,
    )
    if data_parallel_rank == 0:
        parallelism.data_parallel_size = 1
    return pb.EngineInfo(
        engine_name=ENGINE_NAME,
        engine_version=__version__,
        role=role,
        instance_id=instance_id,
        supported_models=model.names,
        parallelism=parallelism,
        kv_connector=kv_connector,
        schema_revision=SCHEMA_REVISION,
        minimum_client_revision=MINIMUM_CLIENT_REVISION,
        schema_release=SCHEMA_RELEASE,
    )


def kv_connector_info(
    role: pb.EngineRole.ValueType, endpoints: Sequence[pb.KvEndpoint]
) -> pb.KvConnectorInfo:
    """A PREFILL or DECODE engine moves KV with `kvplane-pull` (the decode engine pulls over
    gRPC from `endpoints`, the engine's own port); an AGGREGATED one moves none: every
    capability an explicit false."""
    if role not in (pb.ENGINE_ROLE_PREFILL, pb.ENGINE_ROLE_DECODE):
        return pb.KvConnectorInfo(
            enabled=False,
            supports_remote_prefill=False,
            supports_decode_pull=False,
            supports_abort_cleanup=False,
            supports_drain=False,
        )
    return pb.KvConnectorInfo(
        enabled=True,
        transfer_backend=TRANSFER_BACKEND,
        local_endpoints=endpoints,
        supported_protocols=[PROTOCOL],
        supports_remote_prefill=role == pb.ENGINE_ROLE_PREFILL,
        supports_decode_pull=role == pb.ENGINE_ROLE_DECODE,
        supports_abort_cleanup=True,
        supports_drain=True,
        schema_version=1,
    )


def _logprob_caps(model: ServedModel) -> pb.LogprobCapabilities:
    return pb.LogprobCapabilities(
        supported=True, candidate_selection_modes=_ALL_MODES, max_top_n=model.max_top_n
    )


# The guided decoding modes the engine implements (engine/core/guided.py), the proto's order.
GUIDED_MODES = (
    pb.GUIDED_DECODING_MODE_JSON_SCHEMA,
    pb.GUIDED_DECODING_MODE_REGEX,
    pb.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
    pb.GUIDED_DECODING_MODE_CHOICE,
    pb.GUIDED_DECODING_MODE_JSON_OBJECT,
)


def _guided_caps(model: ServedModel) -> pb.GuidedDecodingCapabilities:
    """Guided decoding needs a tokenizer (the torch runner's; the sim runner has none)."""
    if not model.has_tokenizer:
        return pb.GuidedDecodingCapabilities(supported=False)
    return pb.GuidedDecodingCapabilities(supported=True, modes=GUIDED_MODES)


def model_info(model: ServedModel) -> pb.ModelInfo:
    if not model.generates:
        return _pooling_model_info(model)
    text_input = model.has_tokenizer
    return pb.ModelInfo(
        model_id=model.model_id,
        served_model_name=model.name,
        served_model_aliases=list(model.aliases),
        max_context_length=model.max_context_length,
        max_output_tokens=model.max_context_length - 1,
        kv_block_size=model.block_size,
        total_kv_blocks=model.num_blocks,
        max_running_requests=model.max_num_seqs,
        max_batched_tokens=model.max_batched_tokens,
        tokenizer_modes=["hf_tokenizer_json"] if model.has_tokenizer else [],
        supports_text_input=text_input,
        supports_token_ids_input=True,
        generation=pb.GenerationCapabilities(
            prompt_logprobs=_logprob_caps(model),
            output_logprobs=_logprob_caps(model),
            guided_decoding=_guided_caps(model),
            max_num_sequences=model.max_num_seqs,
            supports_priority=True,
            supports_stop_in_output=True,
            supports_cache_salt=True,
            supports_prefix_cache_bypass=True,
        ),
        supports_lora=model.supports_lora,
        supports_multimodal=False,
        tasks=task_capabilities(model),
    )


def _pooling_model_info(model: ServedModel) -> pb.ModelInfo:
    """A pooling-only engine advertises its tasks and no generation: `generation`,
    `max_output_tokens`, `max_running_requests` (generation seats) and the KV geometry
    (`kv_block_size`, `total_kv_blocks`: it keeps no KV cache to route by) are absent. The
    seed's GenerationCapabilities has no `supported` flag, so an absent `generation` next to
    supported tasks is how an engine says it does not generate (`controller.fleet` reads it
    so)."""
    return pb.ModelInfo(
        model_id=model.model_id,
        served_model_name=model.name,
        served_model_aliases=list(model.aliases),
        max_context_length=model.max_context_length,
        max_batched_tokens=model.max_batched_tokens,  # a pooling forward's token budget
        tokenizer_modes=["hf_tokenizer_json"] if model.has_tokenizer else [],
        supports_text_input=model.has_tokenizer,
        supports_token_ids_input=True,
        supports_lora=False,
        supports_multimodal=False,
        tasks=task_capabilities(model),
    )


def task_capabilities(model: ServedModel) -> pb.TaskCapabilities:
    """Embed and Score (cosine of the embeddings) where the model pools; Classify where it
    also has a classification head (`engine.server.pooling_tasks` implements exactly this)."""
    if model.embedding_dimension is None:
        return pb.TaskCapabilities(
            embed=pb.EmbedCapabilities(supported=False),
            classify=pb.ClassifyCapabilities(supported=False),
            score=pb.ScoreCapabilities(supported=False),
        )
    inputs = [pb.TASK_INPUT_TYPE_TOKEN_IDS]
    if model.has_tokenizer:
        inputs.insert(0, pb.TASK_INPUT_TYPE_TEXT)
    both = [pb.TASK_OUTPUT_GRANULARITY_SEQUENCE, pb.TASK_OUTPUT_GRANULARITY_TOKEN]
    classify = pb.ClassifyCapabilities(supported=False)
    if model.classifier_labels is not None:
        classify = pb.ClassifyCapabilities(
            supported=True,
            input_types=inputs,
            granularities=both,
            semantics=[
                pb.TASK_VALUE_SEMANTICS_PROBABILITIES,
                pb.TASK_VALUE_SEMANTICS_LOGITS,
                pb.TASK_VALUE_SEMANTICS_LOG_PROBABILITIES,
            ],
            supports_priority=False,
            supports_lora=False,
        )
    return pb.TaskCapabilities(
        embed=pb.EmbedCapabilities(
            supported=True,
            input_types=inputs,
            granularities=both,
            encodings=[pb.EMBEDDING_ENCODING_DENSE],
            dimension=model.embedding_dimension,
            supports_priority=False,
            supports_lora=False,
            supports_normalization=True,
            supports_dimension_override=True,
        ),
        classify=classify,
        score=pb.ScoreCapabilities(
            supported=True,
            input_types=inputs,
            granularities=[pb.TASK_OUTPUT_GRANULARITY_SEQUENCE],
            semantics=[pb.TASK_VALUE_SEMANTICS_SIMILARITY],
            normalizations=[pb.SCORE_NORMALIZATION_NONE],
            supports_label_token_scoring=False,
            supports_instruction=False,
            supports_priority=False,
            supports_lora=False,
            higher_is_better=True,
        ),
    )


def load_info(
    load: LoadSnapshot,
    *,
    instance_id: str,
    timestamp_unix_ns: int,
    data_parallel_rank: int,
    include_per_rank: bool,
    running_tasks: int = 0,
    waiting_tasks: int = 0,
) -> pb.LoadInfo:
    """`running_tasks`: pooling tasks in flight, of which `waiting_tasks` wait for the engine
    thread: those count as queued requests (as admission control counts them), the others as
    running. `active_kv_sessions` are the sessions the core holds, from the same snapshot as
    the counts, so a finished prefill moves from `running_requests` to it at one instant. The
    one rank's figures are the engine's."""
    running_requests = load.num_running + running_tasks - waiting_tasks
    queued_requests = load.num_waiting + waiting_tasks
    info = pb.LoadInfo(
        instance_id=instance_id,
        timestamp_unix_nanos=timestamp_unix_ns,
        running_requests=running_requests,
        queued_requests=queued_requests,
        active_kv_sessions=load.num_kv_sessions,
        used_kv_blocks=load.num_used_blocks,
        total_kv_blocks=load.num_total_blocks,
        running_tokens=load.running_tokens,
        waiting_tokens=load.waiting_tokens,
        prefill_batch_size=load.prefill_batch_size,
        decode_batch_size=load.decode_batch_size,
        attributes={
            "cached_kv_blocks": str(load.num_cached_blocks),
            "kv_usage": f"{load.kv_usage:.6f}",
        },
    )
    if include_per_rank:
        info.ranks.append(
            pb.RankLoadInfo(
                data_parallel_rank=data_parallel_rank,
                running_requests=running_requests,
                queued_requests=queued_requests,
                used_kv_blocks=load.num_used_blocks,
                total_kv_blocks=load.num_total_blocks,
                prefill_batch_size=load.prefill_batch_size,
                decode_batch_size=load.decode_batch_size,
            )
        )
    return info
