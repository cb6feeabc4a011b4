"""Which logprobs a Generate asks for: one reading for the engine, which computes them
(`engine.server.openengine_convert`, `engine.server.vllm_servicer`), and the controller,
which routes the request only to an engine whose GetModelInfo takes them
(`controller.eligibility`), so that the two never read one request differently.

OpenEngine (`ResponseOptions`): `return_<kind>_logprobs` where it is set (an explicit
false is a value, not the default: the seed's presence rule); absent, a
`<kind>_candidates` selection asks for them, since candidates imply the logprobs they are
scored with. Candidates beside an explicit false contradict it (`contradiction`: the
engine refuses the request, INVALID_ARGUMENT). `vllm.Generate`: `<kind>_logprobs` alone;
a candidate selection without it is ignored, as vLLM's server does."""

from __future__ import annotations

from openengine.v1 import openengine_pb2 as pb
from vllm_grpc import vllm_grpc_pb2 as vpb

# The logprobs a request may ask for: of its prompt's tokens, and of its output's.
KINDS = ("prompt", "output")


def openengine_asks(response: pb.ResponseOptions, kind: str) -> bool:
    """Whether an OpenEngine Generate's `response` options ask for its `kind` logprobs."""
    flag, selected = _flag_and_selection(response, kind)
    return selected if flag is None else flag


def contradiction(response: pb.ResponseOptions, kind: str) -> str | None:
    """Why `response` contradicts itself on its `kind` logprobs (candidates selected with
    the logprobs they are scored with refused), None where it does not."""
    flag, selected = _flag_and_selection(response, kind)
    if selected and flag is False:
        return f"{kind}_candidates is set but return_{kind}_logprobs is false"
    return None


def _flag_and_selection(response: pb.ResponseOptions, kind: str) -> tuple[bool | None, bool]:
    """(`return_<kind>_logprobs`, None where absent; whether `<kind>_candidates` is set)."""
    if kind == "prompt":
        present = response.HasField("return_prompt_logprobs")
        flag, selected = response.return_prompt_logprobs, response.HasField("prompt_candidates")
    else:
        present = response.HasField("return_output_logprobs")
        flag, selected = response.return_output_logprobs, response.HasField("output_candidates")
    return (flag if present else None), selected


def vllm_asks(response: vpb.ResponseOptions, kind: str) -> bool:
    """Whether a `vllm.Generate`'s `response` options ask for its `kind` logprobs."""
    asked: bool = getattr(response, f"{kind}_logprobs")
    return asked
