"""What the controller reads of an engine's GetModelInfo: the request limits (REQUEST_LIMITS)
and option flags (CAPABILITY_FLAGS) it reports, by path, and the `ModelFacts` kept of them
(`model_facts`). The routing over them is controller.eligibility's (ROUTED_LIMITS and
ROUTED_OPTIONS, drawn from these), the fleet's summary controller.fleet_view's."""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from controller.registry import ModelFacts
from kvplane.logprobs_asked import KINDS
from openengine.v1 import openengine_pb2 as pb

# The pooling tasks, as ModelInfo.tasks names their capabilities.
POOLING_TASKS = ("embed", "classify", "score")
# ModelInfo's limits of a request (its optional counts, by path): an engine refuses one past
# them.
REQUEST_LIMITS = (
    "max_context_length",
    "max_output_tokens",
    "generation.max_num_sequences",
    "generation.prompt_logprobs.max_top_n",
    "generation.output_logprobs.max_top_n",
    # A pooling task's, of the engines that have the task (`ModelFacts.constrains`).
    "tasks.embed.max_batch_size",
    "tasks.embed.max_output_values_per_item",
    "tasks.classify.max_batch_size",
    "tasks.classify.max_output_values_per_item",
    "tasks.score.max_groups",
    "tasks.score.max_candidates_per_group",
    "tasks.score.max_output_values_per_candidate",
    "tasks.score.max_label_token_ids",
)
# ModelInfo's flags of request options (its optional bools, by path) that an engine refuses
# a request using when it reports false. `supports_lora` is not one: a request naming an
# adapter is routed to engines holding it.
CAPABILITY_FLAGS = (
    "supports_text_input",
    "supports_token_ids_input",
    "supports_multimodal",
    "generation.prompt_logprobs.supported",
    "generation.output_logprobs.supported",
    "generation.guided_decoding.supported",
    "generation.supports_priority",
    "generation.supports_stop_in_output",
    "generation.supports_cache_salt",
    "generation.supports_prefix_cache_bypass",
    "tasks.embed.supports_priority",
    "tasks.embed.supports_normalization",
    "tasks.embed.supports_dimension_override",
    "tasks.classify.supports_priority",
    "tasks.score.supports_priority",
    "tasks.score.supports_label_token_scoring",
    "tasks.score.supports_instruction",
)

# The ways a request selects its logprobs' candidates (OpenEngine's CandidateTokenSelection
# and vLLM's CandidateTokens name them alike), each with the mode an engine's
# `candidate_selection_modes` lists it by.
SELECTION_MODES = {
    "top_n": pb.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N,
    "token_ids": pb.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS,
    "all": pb.CANDIDATE_TOKEN_SELECTION_MODE_ALL,
}


def selection_option(kind: str, selection: str) -> str:
    """The request option of selecting `kind` ("prompt", "output") logprobs' candidates by
    `selection` (of SELECTION_MODES), by path, as CAPABILITY_FLAGS name theirs: an engine
    whose GetModelInfo lists its candidate selection modes for `kind` lacks it where the
    list leaves its mode out (an empty list reports none: it may take any)."""
    return f"generation.{kind}_logprobs.candidate_selection_modes.{selection}"


SELECTION_OPTIONS = tuple(selection_option(k, s) for k in KINDS for s in SELECTION_MODES)


def field_holder(model: Message, flag: str) -> tuple[Message | None, str]:
    """The message of `model` holding the field at path `flag` (of CAPABILITY_FLAGS or
    REQUEST_LIMITS; None: a message on its way is absent) and the field's name."""
    *path, name = flag.split(".")
    holder: Message | None = model
    for part in path:
        holder = getattr(holder, part) if holder is not None and holder.HasField(part) else None
    return holder, name


def reported(model: Message, path: str) -> Any:
    """The value at `path` (of CAPABILITY_FLAGS or REQUEST_LIMITS) in `model`; None when it,
    or a message on its way, is absent (not reported)."""
    holder, name = field_holder(model, path)
    return getattr(holder, name) if holder is not None and holder.HasField(name) else None


def unsupported(model: pb.ModelInfo) -> frozenset[str]:
    """The CAPABILITY_FLAGS GetModelInfo reports false (absent: not reported), and the
    SELECTION_OPTIONS of the candidate selection modes it leaves out of a list it gives."""
    flags = {flag for flag in CAPABILITY_FLAGS if reported(model, flag) is False}
    for kind in KINDS:
        modes = getattr(model.generation, f"{kind}_logprobs").candidate_selection_modes
        if modes:
            flags.update(
                selection_option(kind, s)
                for s, mode in SELECTION_MODES.items()
                if mode not in modes
            )
    return frozenset(flags)


def supported_tasks(model: pb.ModelInfo) -> frozenset[str]:
    """The pooling tasks GetModelInfo says the model supports."""
    return frozenset(name for name in POOLING_TASKS if getattr(model.tasks, name).supported)


def generates(model: pb.ModelInfo) -> bool:
    """Whether GetModelInfo says the engine generates. The seed's GenerationCapabilities has
    no `supported` flag: an engine that advertises tasks and leaves `generation` out says it
    does not (a kvplane engine with `runner: pooling`); advertising neither: unknown, routed."""
    return model.HasField("generation") or not supported_tasks(model)


def model_facts(model: pb.ModelInfo) -> ModelFacts:
    """What the controller keeps of one model's GetModelInfo (absent scalars stay unknown)."""
    return ModelFacts(
        block_size=reported(model, "kv_block_size"),
        total_kv_blocks=reported(model, "total_kv_blocks"),
        supports_lora=reported(model, "supports_lora"),
        tasks=supported_tasks(model),
        generates=generates(model),
        limits=tuple(
            (path, value) for path in REQUEST_LIMITS if (value := reported(model, path)) is not None
        ),
        max_running_requests=reported(model, "max_running_requests"),
        unsupported=unsupported(model),
        served_name=model.served_model_name,
    )
