"""The one path a generation takes through the gateway, whichever API the client speaks
(OpenEngine Generate or `vllm.Generate`).

A front end describes its API with a `Surface` (how to call an engine, what in a response is
output, usage or a refusal worth retrying, how a failure after output ends the stream); the
`Relay` does everything else, the same way for every front end:

- refuse new requests while the gateway drains, a model no engine serves (NOT_FOUND, as an
  engine answers; UNAVAILABLE while the fleet has no engine at all, which cannot tell), and a
  request id already running through this gateway (ALREADY_EXISTS, as
  an engine answers a duplicate: a second copy would land on another engine, out of Abort's
  reach);
- plan and route the request; a retry never goes back to an engine that already failed it;
  a request naming a LoRA adapter goes only to engines holding it (NOT_FOUND when none has
  it loaded, FAILED_PRECONDITION when no engine supports LoRA, UNAVAILABLE when the holders
  take no traffic), and one an engine refuses NOT_FOUND (a status, or an in-band
  MODEL_NOT_FOUND) before anything was relayed because it no longer holds the adapter goes
  to another holder, else gets that status (`adapter_left`, which the pooling tasks ask too);
- hold request id -> engine while the request runs, so that OpenEngine Abort finds it and
  Drain counts it whatever API started it, and remember the last FINISHED_MEMORY ids an
  engine ran once they end, so that Abort answers ALREADY_FINISHED as the engine would; a
  request aborted before an engine took it (being planned, between two engines, or its call
  not yet accepted) ends here as an engine ends a request aborted before its prefill, status
  OK (`Surface.aborted`: OpenEngine's outputs finished CANCELLED, vllm.Generate's ABORTED),
  and one aborted at the handoff (its prefill engine handed it over, no decode engine holds
  or has accepted it yet; or that engine answered the Abort that its part ended before the
  gateway read the handoff, `ended_at`) ends here as an aborted request ends on an engine,
  every output finished CANCELLED, the last with the prefill's usage, with no decode hop; an
  engine's answer that a request ended releases the router's accounting of it at once;
- relay the engine's responses unchanged; the first output releases the router's prefill
  accounting, the end of the attempt all of it. Leading responses that carry no output,
  only of the prompt (OpenEngine's prompt logprobs; a vLLM server's first response, its
  `prompt_info` alone), are held until the engine's first output (or an in-band error
  passed on as it came, or the end of its stream), then relayed in order: an engine
  failing before its first token has relayed nothing, and is retried as such (below);
- tell the client where the request ran (the seed's responses cannot): trailing metadata
  `kvplane-route` (controller/route_report.py), set as each hop chooses its engine, so that a
  request failing once an engine was chosen carries it too;
- an engine call that fails after its stream's terminal events were relayed (every output
  ended, or an in-band error) adds nothing: the stream ends as the engine ended it;
- retry once on another engine when the engine failed before anything was relayed (a status
  in RETRYABLE, or a retryable in-band error before its first output; an engine removed from
  the fleet mid-request, or unreachable past `health.abandon_streams_after_s`, fails as
  UNAVAILABLE); if no other engine can take it, the client gets the engine's own failure,
  naming the engine unless it refuses the request itself (`pass_status`; `retries_elsewhere`:
  the policy, which the gateway's pooling tasks follow too); an engine's INVALID_ARGUMENT
  before anything was relayed, for a request whose prompt's tokens the gateway did not know
  (a text prompt not tokenised here), goes to an engine taking a longer context than that
  engine's, where one does (the refusal may be of the prompt's length:
  `Controller.past_refusal`), UNAVAILABLE when only engines out of routing do
  (`Relay.past_refusal`: the pooling tasks' unmeasured text inputs follow it too); such a
  re-route past a refusal, as a LoRA one, is not an engine failure: it leaves the one retry
  unspent, and ends as each leaves the refusing engines out (`retries_elsewhere`: the rule
  of every path);
- metrics: route time, time to the first relayed response, request time, outcome, retries
  (after a failure) and re-routes (past a refusal, by reason), and the engine-reported
  usage against the router's prediction. A stream relayed to its end counts as "ok" unless
  its last response was an in-band error ("engine_error"); a request refused for itself (a
  status in CLIENT_ERRORS, from the gateway or the engine) counts as "invalid", an in-band
  OVERLOADED as "overloaded", and one whose client left before any outcome (a cancel, its
  deadline) as "cancelled": every request counts once;
- with `router.reject_when_all_busy`, refuse a new request whose every candidate engine is
  busy (RESOURCE_EXHAUSTED, outcome "overloaded") before any engine is called or charged;
- a model served only by prefill and decode engines takes two hops (`_disaggregated`), each
  one of the above, joined by the API's `Handoff` (OpenEngine's KV session); once the client
  has output from the first hop, any failure ends the stream with one in-band error; a decode
  hop failing before anything was relayed while the prefill engine that holds its session
  does not answer (`Handoff.holder_gone`) runs the request again as a whole, once, without
  that engine, and one whose prefill engine answers as a new process (restarted at its
  address: the session went with the old one) runs again the same way, that engine
  included; one whose first decode engine to fail it (one re-routed past attached no
  session) refused the session NOT_FOUND has the gateway release the session on that
  prefill engine (`Handoff.release`), after which no other decode engine can take it:
  ended there by its drain (`Handoff.holder_draining`), the request ends at the handoff,
  as an aborted request does; otherwise (ended by its TTL, freed by that release, not held
  there: a decode engine took it, or the engine restarted under its configured instance
  id, which GetEngineInfo cannot tell; no answer) it runs again as a whole, once (without
  that engine when it did not answer), and a second session lost so fails it, UNAVAILABLE
  naming the lost session (sent again, it may succeed);
- a hop's failure before anything was relayed is judged alike whether the engine said it
  with a status or in-band (`HopFailure`: an in-band error by its status form), in one
  place (`Relay._judge`); when no other engine takes it, an in-band refusal reaches the
  client as the engine sent it (the seed's one failure by its phase), except one naming the
  request's KV session (KV_SESSION_NOT_FOUND, KV_TRANSFER_FAILED), which the client never
  sent: that ends it as its status form does.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress
from typing import Any, Literal, NamedTuple, NoReturn, Protocol, TypeVar

import grpc

from controller.eligibility import BeyondFleetError
from controller.fleet import BLIND_WARNING_INTERVAL_S, Fleet, ThrottledWarning
from controller.metrics import RequestOutcome, Reroute
from controller.registry import (
    GenerationUnsupportedError,
    LoraRoutingError,
    ModelRequiredError,
    NoEngineRegisteredError,
    Role,
    UnknownModelError,
)
from controller.route_report import Part, RouteReport
from controller.router import AllEnginesBusyError, Decision, NoEngineAvailableError
from controller.service import Controller, Plan, PromptInput
from controller.statuses import status_of
from kvplane.errors import KvplaneError
from kvplane.server import abort_with
from openengine.v1 import openengine_pb2 as pb

log = logging.getLogger(__name__)

# Whether the outcome of the request this gateway call runs was counted (`Relay._count`). Each
# call runs in its own task, so in its own context; one cancelled before its outcome (its
# client cancelled or passed its deadline, or the server stopped) counts as "cancelled".
_outcome_counted: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "outcome_counted", default=False
)
# When the gateway took the request this call runs (`time.perf_counter()`): its outcome is
# timed from then (`Relay._count`).
_started: contextvars.ContextVar[float] = contextvars.ContextVar("started")

Context = grpc.aio.ServicerContext[Any, Any]
Request = TypeVar("Request")
Response = TypeVar("Response")
Request_contra = TypeVar("Request_contra", contravariant=True)
Response_co = TypeVar("Response_co", covariant=True)
Response_contra = TypeVar("Response_contra", contravariant=True)
T = TypeVar("T")

# What an engine run with `auth` answers a call without its token. The controller calls every
# engine with its own `engine_token_file`, never its client's token, so this refuses the
# controller (an engine given a new token before the controller's file was), not the
# request: another engine may take it, and the client is not at fault.
REFUSED_CONTROLLER_TOKEN = frozenset(
    {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
)
# Statuses after which the same request may succeed on another engine.
RETRYABLE = (
    frozenset(
        {
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.ABORTED,
        }
    )
    | REFUSED_CONTROLLER_TOKEN
)
# Statuses that refuse the request itself: no engine would take it as it is.
CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
# How an engine ends a call whose request it aborted (an Abort, a drain's deadline): a pooling
# task, or an older DECODE engine's Generate aborted while it pulled its KV session. An end,
# not a failure: passed to the client as the engine worded it (`pass_status`), counted
# "aborted".
ENGINE_ABORTED = grpc.StatusCode.CANCELLED
# An engine's own failure (a broken device, a wedged worker), which counts toward its outlier
# ejection (controller/registry.py). Not UNAVAILABLE: "not now", a draining engine's refusal
# (vllm.Generate has no in-band DRAINING) or a KV pull the prefill side failed; an engine
# that cannot be reached at all fails its polls too. Nor overload (RESOURCE_EXHAUSTED),
# deadlines, aborts or client errors.
ENGINE_FAULTS = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
)
# What a decode engine answers when it cannot attach the request's KV session (an unknown or
# expired session, a failed transfer): the session failed, not the client's request.
SESSION_REFUSALS = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})
# Finished request ids remembered for Abort's ALREADY_FINISHED (the engine remembers as many).
FINISHED_MEMORY = 10_000
# How long the Abort of a request whose call the fleet ended (`Relay._abort_lost`) waits for
# its engine to be reached.
LOST_ABORT_WAIT_S = 60.0


class Usage(NamedTuple):
    """What an engine reported of a request's prompt; `cached_prompt_tokens` None when the
    engine did not say (absent, not zero)."""

    prompt_tokens: int
    cached_prompt_tokens: int | None


class InBandError(NamedTuple):
    """A terminal error the engine sent as a response (OpenEngine's EngineError);
    `engine_fault`: one of its own (ERROR_CODE_INTERNAL), not the request's or a refusal;
    `not_found`: what the request names is not there (ERROR_CODE_MODEL_NOT_FOUND: its model,
    or its LoRA adapter unloaded after the engine accepted it), as a status NOT_FOUND says;
    `overloaded`: a refusal for capacity (ERROR_CODE_OVERLOADED), counted as the status
    RESOURCE_EXHAUSTED is. `status`: its status form, the status an engine answers for the
    same failure before acceptance (seed: one failure, a status or an EngineError by its
    phase), which `HopFailure` judges it by; `about_session`: it names the request's KV
    session (ERROR_CODE_KV_SESSION_NOT_FOUND, ERROR_CODE_KV_TRANSFER_FAILED), where a status
    cannot say (a decode engine's NOT_FOUND may be of its session or of its model)."""

    message: str
    retryable: bool
    engine_fault: bool = False
    not_found: bool = False
    overloaded: bool = False
    status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    about_session: bool = False

    @property
    def outcome(self) -> RequestOutcome:
        """The request's outcome when this error ends it."""
        return "overloaded" if self.overloaded else "engine_error"


class HopFailure(NamedTuple):
    """How an engine failed a hop before anything of it was relayed, in one form whether it
    said so with a gRPC status or in-band (a terminal EngineError before its first output):
    `Relay._judge` decides what follows alike for both, so that an engine reporting a lost
    KV session in-band is treated as one refusing it NOT_FOUND."""

    # The status, or the in-band error's status form (`InBandError.status`).
    cause: grpc.aio.AioRpcError
    # Another engine may succeed with the request: a status in RETRYABLE; in-band, the
    # engine's own word (EngineError.retryable), which a status does not carry.
    retryable: bool
    # A decode engine refused the request's KV session (SESSION_REFUSALS: an unknown, expired
    # or unusable session, a failed transfer): the session failed, not the client's request.
    refused_session: bool = False
    # What the request names is not there (NOT_FOUND, in-band MODEL_NOT_FOUND): maybe its
    # LoRA adapter, unloaded since it was routed (`Relay.adapter_left`).
    not_found: bool = False
    # The engine's in-band refusal, which ends the request as it is when no other engine
    # can take it; None for a status, and for an in-band error naming the request's KV
    # session (`of_in_band`).
    refusal: Any = None

    @classmethod
    def of_status(cls, cause: grpc.aio.AioRpcError, stage: _Stage) -> HopFailure:
        code = cause.code()
        return cls(
            cause,
            code in RETRYABLE,
            refused_session=stage.carries_session and code in SESSION_REFUSALS,
            not_found=code == grpc.StatusCode.NOT_FOUND,
        )

    @classmethod
    def of_in_band(cls, error: InBandError, refusal: Any, stage: _Stage) -> HopFailure:
        """An engine's in-band error before its first output. One naming the gateway's own KV
        session (`InBandError.about_session`), which the client never sent, is no refusal to
        pass on as it came: it ends the request as its status form does (a refused session:
        UNAVAILABLE; a retryable KV_TRANSFER_FAILED: UNAVAILABLE naming the engine)."""
        of_session = stage.carries_session and error.about_session
        return cls(
            gateway_failure(error.status, error.message),
            error.retryable,
            refused_session=of_session and error.status in SESSION_REFUSALS,
            not_found=error.not_found,
            refusal=None if of_session else refusal,
        )

    @property
    def described(self) -> str:
        return f"{self.cause.code().name}: {self.cause.details()}"

    @property
    def answer(self) -> Any:
        """What the client gets when no other engine takes the request: the engine's own
        in-band refusal, else the status (`_Retry.failure`)."""
        return self.cause if self.refusal is None else self.refusal


class StartedCall(Protocol):
    """A started engine call, which can be stopped (grpc.aio calls are)."""

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


class EngineCall(StartedCall, Protocol[Response_co]):
    """A started engine call's responses, and a way to stop it."""

    def __aiter__(self) -> AsyncIterator[Response_co]: ...


class Surface(Protocol[Request_contra, Response]):
    """One client API, as the relay needs to see it."""

    def call(self, engine: str, request: Request_contra) -> EngineCall[Response]:
        """Start the request on the engine at this address."""
        ...

    def error(self, response: Response) -> InBandError | None:
        """The terminal error this response reports, if the API has such events."""
        ...

    def has_output(self, response: Response) -> bool:
        """Whether the response carries generated output (the prefill is over). The relay
        holds the responses before the first that does (of the prompt alone) until it comes."""
        ...

    def usage(self, response: Response) -> Usage | None: ...

    def num_outputs(self, request: Request_contra) -> int:
        """How many outputs the request asks for (its sequences)."""
        ...

    def outputs_ended(self, request: Request_contra, response: Response) -> int:
        """How many of the request's outputs this response ends: 1 for an output's last
        event, all of them for an event that ends the whole request (a prefill's handoff),
        else 0."""
        ...

    def error_response(
        self, request: Request_contra, message: str, retryable: bool
    ) -> Response | None:
        """The terminal in-band error that ends a stream after output was relayed, or None
        when the API has no such event (the failure then passes as a status). `retryable`:
        whether the unchanged request may succeed if the client sends it again (the seed's
        EngineError.retryable)."""
        ...

    def aborted(self, request: Request_contra) -> list[Response]:
        """The responses that end the request as an engine ends one aborted before its
        prefill, for an abort that reached it before any engine accepted it
        (`Relay._end_aborted`); none for a request that asks for no output at all (an engine
        refuses it), which ends with the status CANCELLED."""
        ...


class GoneHolder(NamedTuple):
    """Why the prefill engine that handed a KV session over no longer holds it
    (`Handoff.holder_gone`)."""

    why: str  # as the client's failure says it: "does not answer", "restarted (...)"
    # A new process answers at its address: up, a new request may go there.
    restarted: bool = False


class Handoff(Protocol[Request, Response_contra]):
    """How an API moves a request from a prefill engine to a decode engine (OpenEngine: the
    prefill stream ends with PrefillReady carrying a KV session; the decode request carries
    it in `kv.session`)."""

    def session(self, response: Response_contra) -> Any | None:
        """The KV session this response hands over, if it is the prefill's handoff event."""
        ...

    def prompt_tokens(self, response: Response_contra) -> int | None:
        """The prompt's tokens, as the prefill's handoff event `response` tells them (None:
        it does not)."""
        ...

    def finished(self, response: Response_contra) -> bool:
        """Whether this response ends the request normally (on a prefill engine: it was
        aborted before the handoff, so there is no decode hop)."""
        ...

    async def release(self, engine: str, session: Any) -> bool:
        """Ask `engine` to free the KV session it handed over (no decode engine attached
        it); raises what the engine answered on failure. True when the engine said the
        session had ended there already (the seed's ALREADY_FINISHED: its drain, its TTL, an
        Abort of it, or its puller's release)."""
        ...

    def with_session(self, request: Request, session: Any) -> Request:
        """The request for the decode engine."""
        ...

    def without_prompt_output(self, request: Request) -> Request:
        """The request without its request-scoped prompt output (prompt logprobs), for an
        engine hop after the client already has it from an earlier one."""
        ...

    async def holder_gone(self, engine: str, instance_id: str | None) -> GoneHolder | None:
        """Whether the prefill engine `engine`, which handed a KV session over as the process
        `instance_id` (None: not known), no longer holds it: unreachable, unanswering, out of
        the fleet, or a new process at its address (restarted); None while that process is
        there. Gone, no decode engine can pull the session from it."""
        ...

    async def holder_draining(self, engine: str) -> bool:
        """Whether the prefill engine `engine`, which said it ended a KV session it handed
        over, drains (its drain's deadline ends every session it holds): the one cause of
        that end a client must see as its request aborted. The seed's Abort answers
        ALREADY_FINISHED alike for a session expired, released or drained."""
        ...

    def cancelled(self, request: Request, handover: Response_contra) -> list[Any]:
        """The terminal events of a request aborted at the handoff (after its prefill engine's
        handoff event `handover`, before a decode engine took it), as an engine ends an
        aborted request: every output finished CANCELLED, the last with the usage the
        prefill reported."""
        ...


class _Stage(NamedTuple):
    """One engine hop of a request: how it counts in the metrics, and how it ends."""

    times_route: bool = True  # observes the time to route
    times_first_response: bool = True  # observes the time to its first relayed response
    last: bool = True  # counts the request's outcome (and times it: `Relay._count`)
    usage: bool = True  # records the engine's usage against the router's prediction
    # The client already has output from an earlier hop: any failure ends the stream with an
    # in-band error, never a status.
    after_output: bool = False
    # The request carries a prefill engine's KV session: an engine refusing it (a status in
    # SESSION_REFUSALS) failed, as an unreachable engine does, rather than the client.
    carries_session: bool = False
    # A stream that ends without error is the engine's success (outlier ejection); the
    # prefill hop's is judged by the caller, by the KV session it handed over or not.
    served_when_done: bool = True
    # A decode hop's question after its engine failed before anything was relayed, given the
    # engine and its failure: is the KV session's holder gone, so that the request must run
    # again as a whole (`_SessionLost`, raised out of the hop) rather than with the session
    # on another decode engine? None: never asked.
    session_lost: Callable[[str, str], Awaitable[_SessionLost | None]] | None = None
    # A decode hop's question after its first engine to fail it (one re-routed past, such as
    # one without the request's LoRA adapter, attached no session) refused the KV session
    # NOT_FOUND before anything was relayed (given the engine and its failure), the
    # session's holder still answering as the process that handed it over: is the session
    # still there for another decode engine? Asking releases it (`Released`), so it never
    # is: ended by the holder's drain, the request ends at the handoff
    # (`_SessionEnd.drained`); gone otherwise (its TTL, the client having read slowly;
    # freed, or maybe freed, by the release, the refusal about something else such as a
    # model the engine no longer serves; not held there, a decode engine having taken it, or
    # the holder restarted under its instance id, which GetEngineInfo cannot tell), the
    # first run raises `_SessionLost` (the request runs again as a whole, once), the run
    # again fails (`_SessionEnd.lost`). None: never asked.
    session_ended: Callable[[str, str], Awaitable[_SessionEnd]] | None = None
    # The prefill hop of a disaggregated request: the engine it picks is the request's
    # prefill engine in its route (`kvplane-route`), unless that is a decode engine
    # prefilling the prompt itself (a retry), which serves the whole request.
    prefills: bool = False


_WHOLE_REQUEST = _Stage()


class _Retry(Exception):
    """The engine failed or refused the request before anything was relayed; try another
    one (the rule: `Relay.retries_elsewhere`)."""

    def __init__(
        self,
        reason: str,
        failure: Any,
        engine: str,
        *,
        reroute: Reroute | None = None,
        excluded: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(reason)
        # What the client gets if no other engine can take the request: the refusing
        # response or the AioRpcError, of `engine`.
        self.failure = failure
        self.engine = engine
        # Why the engine refused what it cannot serve, a re-route that leaves the request's
        # one retry unspent ("lora_adapter": `Relay.adapter_left`; "context": its prompt
        # maybe past the engine's context, `Relay.past_refusal`); None: that one retry, after
        # an engine failure.
        self.reroute = reroute
        # Engines that would refuse it as `engine` did, left out of its next route with
        # those tried (no longer a context than `engine`'s: `Controller.past_refusal`).
        self.excluded = excluded


class _SessionLost(Exception):
    """A decode hop failed before anything was relayed because the request's KV session is
    lost: the prefill engine holding it is gone, or ended it before a decode engine took it
    (its TTL passed while the client read the prefill's output slowly). The request runs
    again as a whole, once; on its prefill engine too when that is there (`holder_up`)."""

    def __init__(
        self, holder: str, failure: grpc.aio.AioRpcError, *, holder_up: bool = False
    ) -> None:
        super().__init__(failure.details())
        self.holder = holder
        self.holder_up = holder_up
        # What the client gets if nothing can take the request again (naming the holder).
        self.failure = failure
        # Whether the client already has output of the request (its prompt's, from the
        # prefill hop): the run again then ends any failure in-band.
        self.shown = False


class _SessionEnd(NamedTuple):
    """What a decode hop learned by releasing its KV session on the prefill engine holding
    it, its first engine to fail it having refused the session NOT_FOUND
    (`_Stage.session_ended`)."""

    # The session ended there by that engine's drain (ALREADY_FINISHED, the engine
    # DRAINING): the request ends at the handoff, as one aborted there
    # (`Relay.aborted_unrouted`), counted "aborted".
    drained: bool = False
    # In the request's run again, the session is gone otherwise (`Released`: ended, freed,
    # not held, or maybe freed): no decode engine can take it, and the request's second KV
    # session being lost, it fails with this (UNAVAILABLE: sent again, it may succeed). (In
    # the first run such a loss raises `_SessionLost` instead.)
    lost: grpc.aio.AioRpcError | None = None


# How the prefill engine holding a KV session answered its release (`Relay._release`): it
# had ended it already; it freed it now; it knows no such session (a decode engine attached
# it, or a process restarted at its address, under its instance id or not); no answer
# (unreachable, timed out, left the fleet), so whether the session is still there is
# unknown. Whatever the answer, no other decode engine can take the session after it.
Released = Literal["ended", "freed", "not_held", "unanswered"]
# What each answer says of the session, as a failure ends with it: "engine HOLDER, which
# held it, ...".
_RELEASE_WORDS: dict[Released, str] = {
    "ended": "had ended it before a decode engine took it (its session TTL passed)",
    "freed": "freed it when asked to release it",
    "not_held": "no longer holds it (a decode engine took it, or the engine restarted)",
    "unanswered": "did not answer its release",
}


class _Verdict(NamedTuple):
    """What follows a hop's failure before anything was relayed (`Relay._judge`)."""

    # How the failure ends the request when nothing else takes it (a refused KV session:
    # the gateway's UNAVAILABLE naming the engine, never the client's NOT_FOUND).
    failure: HopFailure
    # Another engine takes the request (the one retry, or a re-route).
    retry: _Retry | None = None
    # The request's KV session ended on its prefill engine by its drain
    # (`_Stage.session_ended`): the request ends at the handoff, as one aborted there.
    aborted: bool = False


class _Refused(Exception):
    """An engine's in-band refusal of a hop that ends the request as the same status would
    (`_Verdict.failure` without the engine's own response)."""

    def __init__(self, cause: grpc.aio.AioRpcError) -> None:
        super().__init__(cause.details())
        self.cause = cause


class RecentIds:
    """The last `capacity` ids added, the oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: dict[str, None] = {}  # in insertion order: the oldest first

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, request_id: str) -> None:
        self._ids.pop(request_id, None)  # added again: now the newest
        self._ids[request_id] = None
        if len(self._ids) > self.capacity:
            del self._ids[next(iter(self._ids))]

    def discard(self, request_id: str) -> None:
        self._ids.pop(request_id, None)


class Relay:
    """The gateway's in-flight requests and the path that runs each (see the module doc).
    One per gateway, shared by its front ends."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        # request id -> address of the engine serving it now.
        self.holding: dict[str, str] = {}
        # Ids of the requests running through the gateway, from admission to their end (a
        # superset of `holding`: planning, between two engines).
        self.running: set[str] = set()
        # request id -> which admission runs under it (`admission`; the same keys as `running`).
        self._admissions: dict[str, int] = {}
        self._num_admitted = 0
        # Ids of requests an engine ran, once they ended (Abort: ALREADY_FINISHED).
        self.finished = RecentIds(FINISHED_MEMORY)
        # Ids aborted while still being planned, before any engine had them, or while their
        # engine had not accepted them yet: they end here, as an engine ends a request
        # aborted before its prefill (`Surface.aborted`). And ids aborted at the handoff,
        # between their prefill and decode hops: they end here, each output finished
        # CANCELLED (`Handoff.cancelled`).
        self.aborted_unrouted: set[str] = set()
        # request id -> the prefill engine that handed it over (its handoff event came), until
        # the request ends: that engine ran its part, so an Abort of the request is the
        # gateway's to carry out while the decode hop has not started.
        self.handed_over: dict[str, str] = {}
        # Ids of the disaggregated requests in their prefill hop: their engine's part ends with
        # the handoff, which the gateway may not have read yet (`ended_at`).
        self.prefilling: set[str] = set()
        # request id -> its engine call, from the call until the engine's first response (an
        # Abort the engine cannot find yet ends it: abort_unaccepted).
        self._unanswered: dict[str, StartedCall] = {}
        # KV sessions being released in the background (a reference keeps each task alive).
        self._releases: set[asyncio.Task[Released]] = set()
        # Aborts of requests whose calls the fleet ended, sent in the background, by (engine,
        # request id): the same.
        self._lost_aborts: dict[tuple[str, str], asyncio.Task[None]] = {}
        # request id -> where it ran so far, told to its client (`kvplane-route`).
        self._routes: dict[str, RouteReport] = {}
        # Set, and replaced by a new one, at each registry change that can take an engine
        # into or out of routing and at each abort of a request between engines: what a
        # request waiting for a prefill engine wakes on (`_await_prefill`).
        self._woken = asyncio.Event()
        controller.fleet.registry.on_change(self._wake)
        # What `_await_prefill` logs: each waiting request while a prefill engine is out of
        # routing would be a line each.
        self._waiting = ThrottledWarning(
            BLIND_WARNING_INTERVAL_S, controller.clock, log, level=logging.INFO
        )

    def _wake(self) -> None:
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    def admit(self, request_id: str) -> bool:
        """Take `request_id` for a new request; False while one with that id runs here."""
        if request_id in self.running:
            return False
        self.running.add(request_id)
        self._num_admitted += 1
        self._admissions[request_id] = self._num_admitted
        self.finished.discard(request_id)
        return True

    def admission(self, request_id: str) -> int | None:
        """Which admission runs under `request_id` now (None: none): a request ended and another
        admitted with its id are two."""
        return self._admissions.get(request_id)

    def release(self, request_id: str) -> None:
        """The admitted request ended."""
        self.running.discard(request_id)
        self._admissions.pop(request_id, None)
        self.aborted_unrouted.discard(request_id)
        self.handed_over.pop(request_id, None)
        self._routes.pop(request_id, None)

    def _between_engines(self, request_id: str) -> bool:
        """Whether the admitted request is where no engine's Abort reaches it: being planned
        (no engine holds it), between two attempts or hops (from an engine's in-band error
        ending its attempt, `let_go`), or handed over by its prefill engine (whose request
        is finished) before its decode engine holds it."""
        if request_id not in self.running:
            return False
        holder = self.holding.get(request_id)
        return holder is None or self.handed_over.get(request_id) == holder

    def moved_on(self, request_id: str, engine: str) -> bool:
        """Whether the admitted request, once `engine`'s, is another engine's now (a retry, a
        run again, its decode hop)."""
        return request_id in self.running and self.holding.get(request_id) not in (None, engine)

    def abort_unrouted(self, request_id: str) -> bool:
        """Abort a request admitted here that no engine can abort now (`_between_engines`);
        False when there is none. It ends before another engine is called."""
        if not self._between_engines(request_id):
            return False
        self.aborted_unrouted.add(request_id)
        self._wake()
        return True

    def ended_at(self, request_id: str, engine: str) -> bool:
        """`engine` said the request it holds for this gateway ended there (an Abort answered
        ABORTED or ALREADY_FINISHED: seed, the target ended): the router stops charging the
        engine with it now, not once its client has read the rest of its stream. A client
        that stops reading (its flow-control window full, never cancelling) keeps the
        gateway's relay of it open as long as it likes, the engine idle meanwhile. Nothing
        when the request moved on (a decode hop elsewhere is charged anew).

        A prefill hop's engine says so once it has sent its handoff, which the gateway reads
        only after what came before it reached the client (a client that stops reading holds
        it there): the request then ends at the handoff, no decode hop following, as an
        Abort there ends it (`abort_unrouted`). True when it was in its prefill hop."""
        if self.holding.get(request_id) != engine:
            return False
        self.controller.router.finish(request_id)
        if request_id not in self.prefilling:
            return False
        self.aborted_unrouted.add(request_id)
        return True

    def all_ended_at(self, engines: set[str]) -> None:
        """`ended_at` for every request one of `engines` holds for this gateway and has
        answered: they aborted all their requests. Not one whose call they have not answered
        yet: it may reach its engine after the Abort, and run."""
        for request_id, engine in list(self.holding.items()):
            if engine in engines and request_id not in self._unanswered:
                self.ended_at(request_id, engine)

    def abort_unaccepted(self, request_id: str, engine: str) -> bool:
        """Abort a request that `engine` holds for this gateway but has not accepted yet (its
        Abort answered NOT_FOUND: the call is on its way; or it did not answer: stopped,
        wedged, gone), nothing relayed: its call is cancelled, so the engine frees it if it
        arrives or resumes, and it ends here (`_end_aborted`). False when it is not so (it
        answered, or moved on)."""
        call = self._unanswered.get(request_id)
        if call is None or self.holding.get(request_id) != engine:
            return False
        self.aborted_unrouted.add(request_id)
        call.cancel()
        return True

    async def unary(self, request_id: str, call: grpc.aio.UnaryUnaryCall[Any, T]) -> T:
        """The reply to `call`, a unary call (a pooling task) to the engine holding
        `request_id` for this gateway. Until it comes the request is not known to be accepted
        there (one reply says both): an Abort that its engine cannot find ends it here
        (`abort_unaccepted`: the call is cancelled, which this raises)."""
        self._unanswered[request_id] = call
        try:
            return await call
        finally:
            self._unanswered.pop(request_id, None)

    def abort_all_unaccepted(self, engines: set[str]) -> int:
        """`abort_unaccepted` every request whose call one of `engines` has not answered (they
        did not answer an Abort of every request: stopped, wedged, gone); how many."""
        held = [(r, e) for r, e in self.holding.items() if e in engines]
        return sum(self.abort_unaccepted(request_id, engine) for request_id, engine in held)

    def abort_all_unrouted(self) -> int:
        """`abort_unrouted` every admitted request that no engine holds now (Abort of every
        request, a drain aborting its requests: no engine's Abort can reach these); how many
        were not aborted already."""
        unrouted = {r for r in self.running if self._between_engines(r)} - self.aborted_unrouted
        self.aborted_unrouted |= unrouted
        self._wake()
        return len(unrouted)

    async def _await_prefill(
        self, model: str, exclude: frozenset[str], request_id: str, lora_name: str
    ) -> None:
        """Where the disaggregated request would find no prefill engine (none in `exclude`;
        one holding its LoRA adapter `lora_name`, where it names one) to take it while one is
        in the fleet out of routing for a moment (for an adapter: one that holds it, or will
        once back; `Controller.prefill_awaited`), wait for one to take traffic again: at most
        `router.prefill_wait_s`, woken by each registry change, and by the time where the
        engines awaited are dead for long. An abort of the request ends the wait, as its
        client leaving does (its call cancelled: a cancel, its deadline); whatever then, the
        request is routed as it would be then."""
        c = self.controller
        if not c.prefill_wait_s or not c.prefill_awaited(model, exclude, lora_name):
            return
        c.metrics.prefill_waits.inc()
        self._waiting.warn(
            f"request {request_id}: no prefill engine takes traffic; waiting up to "
            f"{c.prefill_wait_s:.1f} s for one"
        )
        with suppress(TimeoutError):
            async with asyncio.timeout(c.prefill_wait_s):
                while request_id not in self.aborted_unrouted and (
                    awaited_s := c.prefill_awaited(model, exclude, lora_name)
                ):
                    timeout_s = None if math.isinf(awaited_s) else awaited_s
                    with suppress(TimeoutError):
                        async with asyncio.timeout(timeout_s):
                            await self._woken.wait()

    async def generate(
        self,
        surface: Surface[Request, Response],
        request: Request,
        query: PromptInput,
        context: Context,
        handoff: Handoff[Request, Response] | None = None,
    ) -> AsyncIterator[Response]:
        """Run one request (see the module doc). `handoff`: how this API moves a request
        from a prefill engine to a decode engine; without one, a model served only by a
        disaggregated fleet is FAILED_PRECONDITION through this front end."""
        c = self.controller
        started = time.perf_counter()
        _started.set(started)
        if c.draining:
            self._count("no_engine")
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, "the controller is draining")
        try:
            c.check_model(query.model, generating=True)
        except (UnknownModelError, ModelRequiredError, GenerationUnsupportedError) as exc:
            self._count("invalid")
            await abort_with(context, status_of(exc), str(exc))
        except NoEngineRegisteredError as exc:
            self._count("no_engine")
            await abort_with(context, status_of(exc), str(exc))
        request_id = query.request_id
        if not self.admit(request_id):
            self._count("invalid")
            await abort_with(
                context, grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is running"
            )
        self._routes[request_id] = RouteReport()
        try:
            stream = self._run(surface, request, query, context, handoff, started=started)
            async with aclosing(stream):
                async for response in stream:
                    yield response
        except (asyncio.CancelledError, GeneratorExit):
            # The call ended before its outcome: the client left (a cancel, its deadline; the
            # front end stops reading this stream), or the server stops.
            if not _outcome_counted.get():
                self._count("cancelled")
            raise
        finally:
            self.release(request_id)

    async def _run(
        self,
        surface: Surface[Request, Response],
        request: Request,
        query: PromptInput,
        context: Context,
        handoff: Handoff[Request, Response] | None,
        *,
        started: float,
    ) -> AsyncGenerator[Response]:
        """An admitted request: planned, then one or two engine hops."""
        c = self.controller
        disaggregated = c.disaggregated(query.model)
        if disaggregated and handoff is not None:
            await self._await_prefill(query.model, frozenset(), query.request_id, query.lora_name)
        try:
            plan = await c.plan(query, role=None if disaggregated else Role.AGGREGATED)
        except (LoraRoutingError, ModelRequiredError, BeyondFleetError) as exc:
            # No routable engine holds the request's LoRA adapter; or, for a request naming
            # no model, the engines' default models came to differ after `check_model` (an
            # engine of another model read meanwhile): its session is keyed by that model; or
            # no engine serving the model takes it (controller.eligibility).
            status = status_of(exc)
            self._count("invalid" if status in CLIENT_ERRORS else "no_engine")
            await abort_with(context, status, str(exc))
        except Exception:
            log.exception("request %s: routing failed", query.request_id)
            self._count("internal")
            await abort_with(context, grpc.StatusCode.INTERNAL, "routing failed; see the log")
        if query.request_id in self.aborted_unrouted:
            # Aborted while it was planned: no engine has seen it, so the gateway ends it.
            for closing in await self._end_aborted(surface, request, _WHOLE_REQUEST, context):
                yield closing
            return
        if not disaggregated:
            stream = self._attempts(
                surface,
                request,
                plan,
                lambda tried: c.route(plan, tried),
                context=context,
                started=started,
            )
        elif handoff is None:  # this API cannot take the prefill -> decode path at all
            self._count("invalid")
            await abort_with(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "this model is served by prefill and decode engines only: use "
                "openengine.v1.OpenEngine/Generate, which hands requests over between them",
            )
        else:
            stream = self._disaggregated(
                surface, handoff, request, query, plan, context=context, started=started
            )
        async with aclosing(stream):
            async for response in stream:
                yield response

    async def _disaggregated(
        self,
        surface: Surface[Request, Response],
        handoff: Handoff[Request, Response],
        request: Request,
        query: PromptInput,
        plan: Plan,
        *,
        context: Context,
        started: float,
    ) -> AsyncGenerator[Response]:
        """Prefill on a prefill engine, then decode on a decode engine with the KV session
        the prefill ended with; or, when the decode engine already holds most of the prompt
        (`router.skip_prefill_ratio`), the decode engine alone. The client sees one stream:
        the prefill's request-scoped output (prompt logprobs), never its handoff event, then
        the decode's."""
        c = self.controller
        try:
            placement = c.route_disaggregated(plan)
        except LoraRoutingError as exc:  # no decode (or prefill) engine holds the adapter
            status = status_of(exc)
            self._count("invalid" if status in CLIENT_ERRORS else "no_engine")
            await abort_with(context, status, str(exc))
        except NoEngineAvailableError as exc:
            self._count("no_engine")
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except AllEnginesBusyError as exc:
            await self._shed(exc, context)
        if placement.decode is not None:  # it prefills the prompt itself
            local = placement.decode

            def decode_locally(tried: frozenset[str]) -> Decision:
                return c.route_decode(plan, tried, prefilled=False) if tried else local

            stream = self._attempts(
                surface, request, plan, decode_locally, context=context, started=started
            )
            async with aclosing(stream):
                async for response in stream:
                    yield response
            return
        assert placement.prefill is not None
        first = placement.prefill
        hops = self._prefill_then_decode(
            surface,
            handoff,
            request,
            plan,
            lambda tried: c.route_prefill(plan, tried) if tried else first,
            context=context,
            started=started,
        )
        try:
            async with aclosing(hops):
                async for response in hops:
                    yield response
            return
        except _SessionLost as exc:
            lost = exc
        # The KV session is lost: the request runs again as a whole, once, the client none the
        # wiser. Its prefill engine gone, where a new request would go with that engine down
        # (another prefill engine, or a decode engine prefilling the prompt itself); its
        # session expired there, where a new request would go. Nothing of the decode hop was
        # relayed, so no token is sent twice; the prompt's own output (prompt logprobs) the
        # client has already is not asked for again.
        log.info("request %s: its KV session is lost (%s); running it again as a whole",
                 plan.request.request_id, lost)  # fmt: skip
        self.handed_over.pop(plan.request.request_id, None)
        excluded = frozenset() if lost.holder_up else frozenset({lost.holder})
        await self._await_prefill(plan.model, excluded, plan.request.request_id, plan.lora_name)
        # Planned again, as a new request would be now: a prefill engine taking traffic only
        # since the first plan (back from a restart: a rolling restart's) is a candidate.
        # Where it is refused now (no engine takes it, its model gone), the first plan's
        # candidates fail it as before.
        with suppress(KvplaneError):
            plan = await c.plan(query, role=None)
        hops = self._prefill_then_decode(
            surface,
            handoff,
            handoff.without_prompt_output(request),
            plan,
            lambda tried: c.route_prefill(plan, tried | excluded),
            context=context,
            started=started,
            lost=lost,
            shown=lost.shown,
        )
        async with aclosing(hops):
            async for response in hops:
                yield response

    async def _prefill_then_decode(
        self,
        surface: Surface[Request, Response],
        handoff: Handoff[Request, Response],
        request: Request,
        plan: Plan,
        route_prefill: Callable[[frozenset[str]], Decision],
        *,
        context: Context,
        started: float,
        lost: _SessionLost | None = None,
        shown: bool = False,
    ) -> AsyncGenerator[Response]:
        """The prefill hop on the engine `route_prefill` picks (a retry may take a decode
        engine prefilling the prompt itself: then that hop is the whole request), then the
        decode hop with the KV session it handed over. Raises `_SessionLost` when the decode
        hop fails before anything was relayed because the session's holder is gone, unless
        this run is already the request's run again (`lost`: what the client gets when no
        engine can take it). `shown`: the client has output of the request already."""
        c = self.controller
        prefilled_on = ""  # the engine of the last prefill attempt

        def prefill_engine(tried: frozenset[str]) -> Decision:
            nonlocal prefilled_on
            decision = route_prefill(tried)
            prefilled_on = decision.engine_id
            return decision

        request_id = plan.request.request_id
        session: Any = None
        handover: Response | None = None  # the prefill engine's handoff event
        holder_instance: str | None = None  # the process that handed the session over
        ended = finished = False
        stream = self._attempts(
            surface,
            request,
            plan,
            prefill_engine,
            context=context,
            started=started,
            stage=_Stage(
                times_first_response=False,
                last=False,
                after_output=shown,
                served_when_done=False,
                prefills=True,
            ),
            retried=None if lost is None else _Retry("KV session lost", lost.failure, lost.holder),
        )
        self.prefilling.add(request_id)
        try:
            async with aclosing(stream):
                async for response in stream:
                    found = handoff.session(response)
                    if found is not None:
                        session, handover = found, response
                        self.handed_over[request_id] = prefilled_on
                        holder_instance = self._instance_of(prefilled_on)
                        continue
                    # Terminal: it ends the request (an aborted prefill ends finished, no
                    # handoff).
                    finished = handoff.finished(response)
                    ended = finished or surface.error(response) is not None
                    if not shown:
                        c.metrics.first_response_seconds.observe(time.perf_counter() - started)
                        shown = True
                    yield response
        finally:
            self.prefilling.discard(request_id)
        if session is not None:
            await self.report(prefilled_on, None)
        else:
            # Counted as any request that ended (aborted) on its engine, unless the gateway
            # ended it so itself (`_end_aborted`: "aborted").
            if finished and not _outcome_counted.get():
                self._count("ok")
            if ended:
                return
            self._count("engine_error")
            message = "the prefill engine ended without handing over a KV session"
            await self.report(prefilled_on, message)  # its stream ended well, its work did not
            ending = surface.error_response(request, message, False) if shown else None
            if ending is None:
                await abort_with(context, grpc.StatusCode.INTERNAL, message)
            yield ending
            return
        decoded = relayed = gone = released = False
        assert handover is not None  # it carried the session
        told = handoff.prompt_tokens(handover)  # the prompt's size, for the decode engine

        async def ended_on_holder(engine: str, failure: str) -> _SessionEnd:
            nonlocal released
            released = True
            answer = await self._release(handoff, prefilled_on, session, request_id)
            if answer == "ended" and await handoff.holder_draining(prefilled_on):
                return _SessionEnd(drained=True)  # a drain's end: it ends at the handoff
            # Gone whatever else the answer (`Released`): no other decode engine can take it.
            why = (
                f"engine {engine} refused the KV session ({failure}): engine {prefilled_on}, "
                f"which held it, {_RELEASE_WORDS[answer]}"
            )
            if lost is not None:  # the run again: its second KV session lost
                log.info("request %s: its KV session is lost again (%s)", request_id,
                         why)  # fmt: skip
                return _SessionEnd(
                    lost=gateway_failure(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{why}; the request's KV session was lost twice (it ran again once "
                        "already): send it again",
                    )
                )
            # The request runs again as a whole, once; without the holder when it did not
            # answer (a process that answers, restarted or not, may take it).
            raise _SessionLost(
                prefilled_on,
                gateway_failure(grpc.StatusCode.UNAVAILABLE, why),
                holder_up=answer != "unanswered",
            )

        stream = self._attempts(
            surface,
            handoff.with_session(request, session),
            plan,
            lambda tried: c.route_decode(plan, tried, prefilled=True, prompt_tokens=told),
            context=context,
            started=started,
            stage=_Stage(
                times_route=False,
                times_first_response=not shown,
                usage=False,
                after_output=shown,
                carries_session=True,
                session_lost=(
                    None if lost is not None else self._lost(handoff, prefilled_on, holder_instance)
                ),
                session_ended=ended_on_holder,
            ),
        )
        try:
            async with aclosing(stream):
                async for response in stream:
                    decoded, relayed = surface.error(response) is None, True
                    yield response
            if not relayed and request_id in self.aborted_unrouted:
                # Aborted at the handoff, before a decode engine took it, or its session ended
                # on its prefill engine (`_end_aborted`).
                for event in handoff.cancelled(request, handover):
                    yield event
        except _SessionLost as exc:
            exc.shown, gone = shown, True
            raise
        finally:
            # No decode engine took the session (or the client left): free it, unless it is
            # gone with its engine, or was freed when asked whether it had ended.
            if not decoded and not gone and not released:
                self._release_session(handoff, prefilled_on, session, request_id)

    @staticmethod
    def _lost(
        handoff: Handoff[Any, Any], holder: str, instance_id: str | None
    ) -> Callable[[str, str], Awaitable[_SessionLost | None]]:
        """A decode hop's `session_lost`: after its engine failed before anything was relayed,
        the prefill engine `holder` is asked whether the process `instance_id` that handed the
        session over is still there. Recognised so, rather than by the decode engine's status,
        because that status says nothing certain of the cause: a pull from a dead engine is
        UNAVAILABLE, as is a decode engine that cannot be reached, or one that is draining;
        and engines of other builds word it their own way. A new process at the holder's
        address (restarted) answers, but knows nothing of the session (its release:
        NOT_FOUND): the session is gone as with a dead holder, and the request runs again
        where a new request would go, that engine included (it is up). Only a new instance
        id tells that process apart: one restarted under the `instance_id` of its config
        answers as the old one did (the seed's GetEngineInfo, Health and GetLoad carry no
        start time or incarnation), and is found out by the release, which it answers
        NOT_FOUND (`_Stage.session_ended`)."""

        async def lost(engine: str, failure: str) -> _SessionLost | None:
            gone = await handoff.holder_gone(holder, instance_id)
            if gone is None:
                return None  # the session is there: another decode engine may take it
            return _SessionLost(
                holder,
                gateway_failure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"engine {holder}, which held the request's KV session, {gone.why} "
                    f"(engine {engine} failed the request: {failure})",
                ),
                holder_up=gone.restarted,
            )

        return lost

    def _instance_of(self, engine: str) -> str | None:
        """The instance id the registry knows the engine at this address by, None when it
        has not read its identity (or it left)."""
        record = self.controller.fleet.registry.by_engine_id(engine)
        if record is None or record.identity is None:
            return None
        return record.identity.instance_id

    def _release_session(
        self, handoff: Handoff[Any, Any], engine: str, session: Any, request_id: str
    ) -> None:
        """`_release` in the background: the client's answer does not wait for it."""
        task = asyncio.create_task(
            self._release(handoff, engine, session, request_id),
            name=f"release KV session of {request_id}",
        )
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _abort_lost(self, engine: str, request_id: str) -> None:
        """The fleet ended the call to `engine` (`engine_failure`: its connection went
        silent, its outage lasted too long), whose cancellation may never reach the engine
        (lost with its connection), which would run the request on: an Abort of it is sent
        in the background on the engine's current channel, waiting up to `LOST_ABORT_WAIT_S`
        in all for the engine to be reached; ended with its channel (which the fleet closes
        as it closed the call's: a connection that never got through before the engine
        answered on a newer one), it is sent again on the engine's channel then. Best-effort
        (failing, a debug line; the engine gone from the fleet, nothing). The retry of a
        request with no output yet goes to another engine, which it cannot end."""
        fleet = self.controller.fleet

        async def abort() -> None:
            deadline = time.monotonic() + LOST_ABORT_WAIT_S
            while (left_s := deadline - time.monotonic()) > 0:
                try:
                    stub = fleet.stub(engine)
                except KeyError:  # it left the fleet: its channel is closed
                    return
                try:
                    await stub.Abort(
                        pb.AbortRequest(request_id=request_id),
                        timeout=left_s,
                        wait_for_ready=True,
                    )
                    return
                except grpc.aio.AioRpcError as exc:
                    log.debug("request %s: its Abort on %s, whose call was ended, failed: %s: %s",
                              request_id, engine, exc.code().name, exc.details())  # fmt: skip
                    return
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is None or task.cancelling():  # this Abort's own (a shutdown)
                        raise
                    # (Its channel closed under it: the engine's current one is another.)

        key = (engine, request_id)
        task = asyncio.create_task(abort(), name=f"abort lost request {request_id} on {engine}")
        self._lost_aborts[key] = task

        def done(task: asyncio.Task[None]) -> None:
            if self._lost_aborts.get(key) is task:
                del self._lost_aborts[key]

        task.add_done_callback(done)

    def _drop_lost_abort(self, engine: str, request_id: str) -> None:
        """The request is sent to `engine` again (a client's retry with its id): the Abort of
        its earlier call there still pending (`_abort_lost`) would end this one, not that
        one: dropped. That one, should it still run, has the engine refuse this one as a
        duplicate."""
        task = self._lost_aborts.pop((engine, request_id), None)
        if task is not None:
            task.cancel()

    @staticmethod
    async def _release(
        handoff: Handoff[Any, Any], engine: str, session: Any, request_id: str
    ) -> Released:
        """Free a KV session no decode engine attached on the prefill engine that holds it;
        how that engine answered (`Released`: whether it had ended the session already,
        `Handoff.release`). An engine that no longer knows it (a decode engine attached it
        before failing, a restarted engine) answers NOT_FOUND."""
        try:
            return "ended" if await handoff.release(engine, session) else "freed"
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                log.debug("request %s: engine %s no longer knows its KV session: %s",
                          request_id, engine, exc.details())  # fmt: skip
                return "not_held"
            log.warning("request %s: releasing its KV session on %s failed: %s: %s",
                        request_id, engine, exc.code().name, exc.details())  # fmt: skip
        except KeyError:  # the engine left the fleet, and its sessions with it
            pass
        return "unanswered"

    async def _attempts(
        self,
        surface: Surface[Request, Response],
        request: Request,
        plan: Plan,
        route: Callable[[frozenset[str]], Decision],
        *,
        context: Context,
        started: float,
        stage: _Stage = _WHOLE_REQUEST,
        retried: _Retry | None = None,
    ) -> AsyncGenerator[Response]:
        """One engine hop of a request: `route` (given the engines that already failed or
        refused it) picks the engine; before anything was relayed, re-routed past an
        engine's refusal of what it cannot serve and retried once elsewhere after an engine
        failure (`Relay.retries_elsewhere`). `retried`: the hop is itself that retry (a
        request run again as a whole), and this is what the client gets when no engine can
        take it."""
        c = self.controller
        request_id = plan.request.request_id
        # The responses read from each engine call, counted: a connection whose calls bring
        # some is alive, however late it answers a poll (`Fleet._end_silent_calls`).
        calls_heard = c.fleet.calls_heard
        tried: set[str] = set()
        # The hop's latest move to another engine, a re-route or the one retry (its next
        # route counts it).
        moved = retried
        # Its one retry, once spent (a re-route past a refusal spends none): the engine that
        # failed it. What the client gets when no engine takes it is that engine's failure,
        # where one failed it, else the latest refusal's (NoEngineAvailableError, below).
        failed = retried
        # The engine that failed the request before its output, sending it to the next one.
        sent_from = retried.engine if retried is not None else None
        while True:
            if request_id in self.aborted_unrouted:  # between two engines (abort_unrouted)
                for closing in await self._end_aborted(surface, request, stage, context):
                    yield closing
                return
            try:
                decision = route(frozenset(tried))
            except AllEnginesBusyError as exc:  # a new request only: nothing relayed yet
                await self._shed(exc, context)
            # Its adapter left its engines since the plan; its prompt, told at the handoff,
            # is past every decode engine's context or KV cache.
            except (LoraRoutingError, BeyondFleetError) as exc:
                status = gateway_failure(status_of(exc), str(exc))
                self._count(_failure_outcome(status.code()))
                ending = self._ending(surface, request, stage, status, relayed=False)
                if ending is None:
                    await pass_status(context, status, None, c.fleet)
                yield ending
                return
            except NoEngineAvailableError as exc:
                # An engine that failed the request could have served it (it took what the
                # others refused): its failure says more than a refusal past it.
                answer = failed or moved
                failure: Any = answer.failure if answer is not None else None
                if failure is None or isinstance(failure, grpc.aio.AioRpcError):
                    # No engine at all, or the failed engine's status is the answer, counted
                    # by it as when that engine ends the request (a refusal of the request
                    # itself: "invalid").
                    status = failure or gateway_failure(grpc.StatusCode.UNAVAILABLE, str(exc))
                    self._count("no_engine" if failure is None else _failure_outcome(status.code()))
                    failure = self._ending(surface, request, stage, status, relayed=False)
                    if failure is None:
                        await pass_status(
                            context, status, answer.engine if answer else None, c.fleet
                        )
                else:  # counted as when the engine's in-band error ends the request
                    refusal = surface.error(failure)
                    self._count(refusal.outcome if refusal is not None else "engine_error")
                yield failure  # an in-band error: the refusing response, or the gateway's
                return
            if moved is not None:  # every route but the hop's first follows a move
                c.metrics.count_move(moved.reroute)
            elif stage.times_route:
                c.metrics.route_seconds.observe(time.perf_counter() - started)
            self._tell_route(request_id, decision, stage, context, sent_from)
            engine = sent_from = decision.engine_id
            tried.add(engine)
            relayed = False
            # The engine's leading responses that carry no generated output, only of the
            # prompt (OpenEngine's prompt logprobs; a vLLM engine's first response, its
            # `prompt_info` alone): held until its first output, or an in-band error passed
            # on as it came, or the end of its stream, then relayed in order, unchanged. A
            # failure before then is one before anything was relayed (retried elsewhere),
            # and they go with the failed attempt: the retry's own are relayed.
            held: list[Response] = []
            # Outputs that ended, and the request's: once all have, or an in-band error was
            # relayed, the client has every terminal event it will get.
            num_ended, num_outputs = 0, surface.num_outputs(request)
            usage: Usage | None = None
            error: InBandError | None = None
            call: EngineCall[Response] | None = None
            try:
                self.holding[request_id] = engine
                if self._lost_aborts:  # (the usual case: none)
                    self._drop_lost_abort(engine, request_id)
                try:
                    call = surface.call(engine, request)
                except KeyError:  # it left the fleet after the request was planned
                    raise gateway_failure(
                        grpc.StatusCode.UNAVAILABLE, f"engine {engine} left"
                    ) from None
                self._unanswered[request_id] = call
                late: grpc.aio.AioRpcError | None = None  # a failure after the stream's end
                try:
                    async for response in call:
                        self._unanswered.pop(request_id, None)
                        calls_heard.heard(call)
                        error = surface.error(response)
                        usage = surface.usage(response) or usage
                        if not relayed:
                            if error is not None:  # judged as the same status is (below)
                                # The engine ended the request with it: while the verdict is
                                # reached (its KV session's holder asked, over the network)
                                # an Abort is the gateway's, and ends it (`abort_unrouted`).
                                self.let_go(request_id, engine)
                                refused = HopFailure.of_in_band(error, response, stage)
                                verdict = await self._judge(
                                    refused, stage, engine, plan, retried=failed is not None
                                )
                                if verdict.aborted:
                                    for closing in await self._end_aborted(
                                        surface, request, stage, context
                                    ):
                                        yield closing
                                    return
                                if request_id in self.aborted_unrouted:
                                    for closing in await self._end_aborted(
                                        surface, request, stage, context
                                    ):
                                        yield closing
                                    return
                                if verdict.retry is not None:
                                    raise verdict.retry
                                if verdict.failure.refusal is None:
                                    raise _Refused(verdict.failure.cause)
                            elif not surface.has_output(response):
                                held.append(response)
                                continue
                            self._first_relayed(stage, started)
                            relayed = True
                            for leading in held:
                                yield leading
                        if surface.has_output(response):
                            c.router.first_token(request_id)
                        num_ended += surface.outputs_ended(request, response)
                        yield response
                    if not relayed and held:  # it ended with no output (its prompt's alone)
                        self._first_relayed(stage, started)
                        relayed = True
                        for leading in held:
                            yield leading
                except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
                    if error is None and not (relayed and num_ended >= num_outputs):
                        raise
                    # Every terminal event is relayed: an error now would be one more after
                    # the end (seed: nothing follows a stream's terminal event). The stream
                    # ends as the engine ended it; the engine's record notes the failure.
                    late = engine_failure(caught, engine, c.fleet)
                    log.warning("request %s: engine %s failed after the end of its stream: "
                                "%s: %s", request_id, engine, late.code().name,
                                late.details())  # fmt: skip
                    await self.report_failure(engine, late)
                if stage.last or error is not None:
                    self._count("ok" if error is None else error.outcome)
                if usage is not None and stage.usage:
                    self._record_usage(decision.predicted_cached_tokens, usage)
                if error is None and late is None and stage.served_when_done:
                    await self.report(engine, None)
                elif error is not None and error.engine_fault:
                    await self.report(engine, error.message)
                return
            except _Retry as exc:
                if error is not None and error.engine_fault:
                    await self.report(engine, error.message)
                moved = exc
                failed = exc if exc.reroute is None else failed
                tried |= exc.excluded
            except _Refused as exc:
                yield await self._failed(
                    surface, request, stage, exc.cause, engine=engine, context=context
                )
                return
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as caught:
                cause = engine_failure(caught, engine, c.fleet)
                if isinstance(caught, asyncio.CancelledError):  # the fleet ended the call
                    self._abort_lost(engine, request_id)
                if not relayed and request_id in self.aborted_unrouted:  # abort_unaccepted
                    for closing in await self._end_aborted(surface, request, stage, context):
                        yield closing
                    return
                await self.report_failure(engine, cause)
                if not relayed:
                    failure = HopFailure.of_status(cause, stage)
                    verdict = await self._judge(
                        failure, stage, engine, plan, retried=failed is not None
                    )
                    if verdict.aborted:
                        for closing in await self._end_aborted(surface, request, stage, context):
                            yield closing
                        return
                    if verdict.retry is not None:
                        moved = verdict.retry
                        failed = moved if moved.reroute is None else failed
                        tried |= moved.excluded
                        continue
                    cause = verdict.failure.cause
                yield await self._failed(
                    surface, request, stage, cause, engine=engine, context=context, relayed=relayed
                )
                return
            finally:
                self._unanswered.pop(request_id, None)
                if call is not None:
                    calls_heard.forget(call)
                    if not call.done():
                        call.cancel()
                c.router.finish(request_id)
                self.let_go(request_id, engine)

    def _first_relayed(self, stage: _Stage, started: float) -> None:
        """A hop relays its first response now: observe the time to it, when the hop says so
        (`_Stage.times_first_response`)."""
        if stage.times_first_response:
            elapsed = time.perf_counter() - started
            self.controller.metrics.first_response_seconds.observe(elapsed)

    def let_go(self, request_id: str, engine: str) -> None:
        """`engine` no longer holds the request for this gateway (its call ended, or it ended
        the request with an in-band error): an Abort of it is the gateway's to carry out
        while it runs on (`abort_unrouted`), ALREADY_FINISHED once it ended."""
        if self.holding.get(request_id) == engine:
            del self.holding[request_id]
            self.finished.add(request_id)

    async def _judge(
        self,
        failure: HopFailure,
        stage: _Stage,
        engine: str,
        plan: Plan,
        *,
        retried: bool,
    ) -> _Verdict:
        """What follows `engine` failing a hop before anything of it was relayed, whichever
        form it said it in (`HopFailure`); `retried`: whether it spent its one retry (a
        decode hop's: whether a decode engine failed it before, maybe having attached its KV
        session; an engine re-routed past attached none). In order: a decode hop whose KV
        session is lost (its holder gone: `_Stage.session_lost`; gone from its holder other
        than by its drain, the release that asked answering: `_Stage.session_ended`) raises
        `_SessionLost`, and in the request's run again fails with no retry; one whose first
        engine to fail it (past any re-route) found no session that its holder's drain ended
        ends at the handoff; an engine
        that no longer holds the request's LoRA adapter is left for one that does (a decode
        engine's NOT_FOUND too, which its session did not cause), and one refusing a prompt
        maybe past its context for one taking a longer one (re-routes, whatever was spent);
        a refused session is the engine's failure (UNAVAILABLE), not the client's; else the
        one retry, when it is not spent and another engine may succeed
        (`retries_elsewhere`)."""
        request_id = plan.request.request_id
        if stage.session_lost is not None:
            lost = await stage.session_lost(engine, failure.described)
            if lost is not None:
                raise lost
        adapter_left = failure.not_found and await self.adapter_left(
            request_id, plan.lora_name, engine
        )
        end = _SessionEnd()
        if (
            failure.refused_session
            and failure.cause.code() == grpc.StatusCode.NOT_FOUND
            and not retried  # no decode engine attached the session before
            and stage.session_ended is not None
            and not adapter_left
        ):
            end = await stage.session_ended(engine, failure.described)
        if end.drained:
            log.info("request %s: engine %s refused its KV session, which %s ended by its "
                     "drain; the request ends at the handoff", request_id, engine,
                     self.handed_over.get(request_id))  # fmt: skip
            self.aborted_unrouted.add(request_id)
            return _Verdict(failure, aborted=True)
        if end.lost is not None:  # no decode engine can take it: no retry
            return _Verdict(HopFailure(end.lost, retryable=False))
        if adapter_left:
            rerouted = _Retry(failure.described, failure.answer, engine, reroute="lora_adapter")
            return _Verdict(failure, rerouted)
        if failure.refused_session:
            refused = gateway_failure(
                grpc.StatusCode.UNAVAILABLE,
                f"engine {engine} refused the KV session: {failure.described}",
            )
            failure = HopFailure(refused, retryable=True)
        # Its prompt's length unknown here, maybe past this engine's context or KV cache:
        # to an engine taking a longer context, where there is one (the KV session of a
        # decode hop is never moved so).
        try:
            shorter = self.past_refusal(
                request_id,
                engine,
                failure.cause,
                failure.described,
                unmeasured=not plan.tokenized and not stage.carries_session,
                longer=lambda: self.controller.past_refusal(plan, engine),
            )
        except NoEngineAvailableError as exc:  # only engines out of routing take more
            unavailable = gateway_failure(grpc.StatusCode.UNAVAILABLE, str(exc))
            return _Verdict(HopFailure(unavailable, retryable=False))
        if shorter is not None:
            rerouted = _Retry(
                failure.described, failure.answer, engine, reroute="context", excluded=shorter
            )
            return _Verdict(failure, rerouted)
        if self.retries_elsewhere(
            request_id, engine, failure.described, retryable=failure.retryable, retried=retried
        ):
            return _Verdict(failure, _Retry(failure.described, failure.answer, engine))
        return _Verdict(failure)

    async def _failed(
        self,
        surface: Surface[Request, Response],
        request: Request,
        stage: _Stage,
        cause: grpc.aio.AioRpcError,
        *,
        engine: str,
        context: Context,
        relayed: bool = False,
    ) -> Response:
        """End the client's stream after `engine` failed its hop with `cause`, nothing else
        taking the request: the status passes (`pass_status`), or, once the client has
        output, one in-band error (`_ending`), which is returned."""
        self._count(_failure_outcome(cause.code()))
        failed = gateway_failure(
            cause.code(), f"engine {engine} failed mid-stream: {cause.code().name}: "
            f"{cause.details()}"
        )  # fmt: skip
        ending = self._ending(surface, request, stage, failed, relayed=relayed)
        if ending is None:
            await pass_status(context, cause, engine, self.controller.fleet)
        return ending

    async def adapter_left(self, request_id: str, lora_name: str, engine: str) -> bool:
        """Whether `engine`, refusing a request naming the LoRA adapter `lora_name` NOT_FOUND
        before anything was relayed (a status, or OpenEngine's in-band MODEL_NOT_FOUND after
        acceptance), refused it because it does not hold the adapter: an UnloadLora landed
        after the request was routed there (it takes the adapter out of routing before the
        engine is asked, so the registry knows by now), or the controller's knowledge is
        stale (a process restarted faster than a poll, an unload behind its back, or, on an
        engine that ends an accepted request MODEL_NOT_FOUND, in the instant between its check
        and its engine thread taking the request: the engine's adapters are read again). An
        engine still holding it refused something else (an unknown base model): False. True:
        the request goes to another engine holding the adapter, else gets the fleet's LoRA
        status (NOT_FOUND "no engine has LoRA adapter ..."), never the engine's bare refusal;
        a re-route, which leaves the request's one retry unspent (`retries_elsewhere`).
        Generate and the pooling tasks alike ask here."""
        if not lora_name:
            return False
        fleet = self.controller.fleet
        record = fleet.registry.by_engine_id(engine)
        if record is None:
            return False
        if record.holds_lora(lora_name):
            await fleet.refresh_loras(record.address)
            if record.holds_lora(lora_name):
                return False  # it holds it: the refusal is about something else
        log.info("request %s: engine %s no longer holds LoRA adapter %r; routing it again",
                 request_id, engine, lora_name)  # fmt: skip
        return True

    @staticmethod
    def past_refusal(
        request_id: str,
        engine: str,
        cause: grpc.aio.AioRpcError,
        described: str,
        *,
        unmeasured: bool,
        longer: Callable[[], T | None],
    ) -> T | None:
        """Where `engine` refused a request with `cause` before anything was relayed, and the
        request is `unmeasured` (its prompt's, or a pooling input's, tokens not known here):
        an INVALID_ARGUMENT may be of its length, past that engine's context, so `longer()`,
        where it goes instead, to an engine taking a longer context (logged; None: none
        does, the refusal stands): a re-route, which leaves the request's one retry unspent
        (`retries_elsewhere`). NoEngineAvailableError (from `longer`: only engines out of
        routing take more) naming the refusal. None for any other failure. Generate and the
        pooling tasks alike ask here."""
        if cause.code() != grpc.StatusCode.INVALID_ARGUMENT or not unmeasured:
            return None
        try:
            found = longer()
        except NoEngineAvailableError as exc:
            raise NoEngineAvailableError(
                f"engine {engine} refused the request ({described}), maybe for its length; {exc}"
            ) from None
        if found is not None:
            log.info("request %s: engine %s refused it (%s); sending it to one taking a "
                     "longer context", request_id, engine, described)  # fmt: skip
        return found

    @staticmethod
    def retries_elsewhere(
        request_id: str, engine: str, described: str, *, retryable: bool, retried: bool
    ) -> bool:
        """Whether a request that `engine` failed before anything was relayed (`described`;
        `retryable`: a status in RETRYABLE, or a retryable in-band error) goes to another
        engine: the one retry of a request (logged), unless it was `retried` already.
        The rule of every path (Generate and vllm.Generate, each hop of a disaggregated one,
        the pooling tasks): an engine refusing what it cannot serve (a LoRA adapter it no
        longer holds, `adapter_left`; a prompt or input maybe past its context,
        `past_refusal`) did not fail: the request is re-routed past it, to engines that can
        serve what it refused, without spending that retry, and each re-route leaves the
        refusing engines out of the request's later routes, so that they end. Counted apart
        (`Metrics.count_move`): `retries` the retries, `reroutes` the re-routes by reason."""
        if retried or not retryable:
            return False
        log.info("request %s: engine %s failed before the first response (%s); retrying "
                 "elsewhere", request_id, engine, described)  # fmt: skip
        return True

    def _tell_route(
        self,
        request_id: str,
        decision: Decision,
        stage: _Stage,
        context: Context,
        sent_from: str | None,
    ) -> None:
        """Note the engine a hop chose in the request's route (`sent_from`: the engine that
        failed it before its output, if any) and set the call's trailing metadata to the
        route now: a failure aborts the call with the metadata set by then."""
        route = self._routes.get(request_id)
        if route is None:
            return
        record = self.controller.fleet.registry.by_engine_id(decision.engine_id)
        part: Part = "decode" if stage.carries_session else "whole"
        if stage.prefills and (
            record is None or record.identity is None or record.identity.role is Role.PREFILL
        ):
            part = "prefill"
        instance_id = record.engine_id if record is not None else decision.engine_id
        route.chose(decision, instance_id, part, failed=sent_from)
        context.set_trailing_metadata(route.metadata())

    def _count(self, outcome: RequestOutcome) -> None:
        """Count the outcome of the request this call runs, once (`_outcome_counted`), and
        time it from when the gateway took it."""
        _outcome_counted.set(True)
        self.controller.metrics.count_request(outcome, time.perf_counter() - _started.get())

    async def _end_aborted(
        self,
        surface: Surface[Request, Response],
        request: Request,
        stage: _Stage,
        context: Context,
    ) -> list[Response]:
        """End a hop whose request was aborted where no engine's Abort reached it
        (`abort_unrouted`, `abort_unaccepted`, or its KV session ended by its prefill
        engine's drain), nothing relayed in it: the responses that end it as an engine ends
        a request aborted before its prefill, status OK (`Surface.aborted`; CANCELLED for a
        request that asks for no output, which an engine would have refused); a decode hop
        (it carries a KV session: the prefill engine accepted the request) returns empty
        instead, for `_prefill_then_decode` to end the request as an engine ends an aborted
        one (`Handoff.cancelled`)."""
        self._count("aborted")
        if stage.carries_session:
            return []
        ending = surface.aborted(request)
        if not ending:
            await abort_with(context, grpc.StatusCode.CANCELLED, "aborted before an engine took it")
        return ending

    async def _shed(self, refusal: AllEnginesBusyError, context: Context) -> NoReturn:
        """Refuse a new request because every engine that could take it is busy (load
        shedding, `router.reject_when_all_busy`): no engine was called or charged."""
        self._count("overloaded")
        await abort_with(context, status_of(refusal), str(refusal))

    @staticmethod
    def _ending(
        surface: Surface[Request, Response],
        request: Request,
        stage: _Stage,
        error: grpc.aio.AioRpcError,
        *,
        relayed: bool,
    ) -> Response | None:
        """How a failed hop ends the client's stream: an in-band error once the client has
        output (from this hop or an earlier one), else None (the status passes). Retryable
        when the hop failed with a status another engine may not (RETRYABLE: the engine
        died, left, was unreachable): sent again, the request is routed anew and can succeed."""
        if not (relayed or stage.after_output):
            return None
        retryable = error.code() in RETRYABLE
        return surface.error_response(request, error.details() or error.code().name, retryable)

    async def report(self, engine: str, fault: str | None) -> None:
        """Tell the fleet how `engine` did with a request: served (`fault` None) or failed by
        a fault of its own, which may eject it from routing."""
        c = self.controller
        if await c.fleet.on_request_result(engine, fault) is not None:
            c.metrics.ejections.inc()

    async def report_failure(self, engine: str, error: grpc.aio.AioRpcError) -> None:
        """`report` a call to `engine` that ended with `error`, when that is a fault of the
        engine's own (ENGINE_FAULTS)."""
        if error.code() in ENGINE_FAULTS:
            await self.report(engine, f"{error.code().name}: {error.details()}")

    def _record_usage(self, predicted: int, usage: Usage) -> None:
        """Prompt tokens always; the router's prediction only beside an engine-reported
        cached count, so that the two totals compare the same requests."""
        m = self.controller.metrics
        m.prompt_tokens.inc(usage.prompt_tokens)
        if usage.cached_prompt_tokens is not None:
            m.record_cache_prediction(predicted, usage.cached_prompt_tokens)


def engine_failure(
    caught: grpc.aio.AioRpcError | asyncio.CancelledError, engine: str, fleet: Fleet
) -> grpc.aio.AioRpcError:
    """How an engine call failed. A call cancelled while this request is not (its handler's
    task has no cancellation pending) was cancelled by the fleet closing the engine's
    channel: the engine left (RemoveEngine), it was unreachable longer than
    `health.abandon_streams_after_s` (a stopped process, a vanished host: its calls would
    otherwise wait for the clients' deadlines), or the call's connection went silent while
    the engine answers on a new one (`Fleet._end_silent_calls`). Each way it fails as an
    unreachable engine does, saying why (UNAVAILABLE: retried elsewhere before output, one
    terminal EngineError after; `Relay._abort_lost` tells the engine). Handled here rather
    than by closing a removed engine's channel late: the fleet would have to know the
    relay's requests, and a grace period would only delay the hang of the longest streams.
    The request's own cancellation (the client left, the server stops) goes on."""
    if isinstance(caught, grpc.aio.AioRpcError):
        return caught
    task = asyncio.current_task()
    if task is None or task.cancelling():
        raise caught
    return gateway_failure(
        grpc.StatusCode.UNAVAILABLE, f"engine {engine} {fleet.why_calls_ended(engine)}"
    )


def naming_engine(failure: grpc.aio.AioRpcError, engine: str, call: str, fleet: Fleet) -> str:
    """The details of an engine's failed `call` as the controller reports them to its own
    client: naming the engine, unless they do already ("engine ADDRESS left"), and the
    controller's setting the failure most likely comes from (an engine refusing the token
    is refusing `engine_token_file`'s, never the client's). The engine's bare status ("Socket
    closed": its process died) would read as the controller's."""
    details = failure.details() or failure.code().name
    if details.startswith(f"engine {engine}"):
        return details
    code = failure.code()
    return f"engine {engine} failed the {call}: {code.name}: " + fleet.engine_failure_details(
        code, details
    )


def _failure_outcome(code: grpc.StatusCode) -> RequestOutcome:
    if code == ENGINE_ABORTED:
        return "aborted"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "overloaded"  # refused for capacity (`max_queued_requests`), as shedding counts
    return "invalid" if code in CLIENT_ERRORS else "engine_error"


def gateway_failure(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A failure of the gateway's own, shaped like an engine's."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def pass_status(
    context: Context, error: grpc.aio.AioRpcError, engine: str | None, fleet: Fleet
) -> NoReturn:
    """End the client's call with `engine`'s failure. A refusal of the request itself (a
    status in CLIENT_ERRORS) is the engine's answer to the client, passed as it is, and so
    is its abort (ENGINE_ABORTED: not a failure, "aborted" when it said nothing); any other
    failure names the engine: its bare status ("Socket closed": its process died) would read
    as the controller's own."""
    code = error.code()
    if code == ENGINE_ABORTED:
        await abort_with(context, code, error.details() or "aborted")
    if engine is None or code in CLIENT_ERRORS:
        await abort_with(context, code, error.details() or code.name)
    await abort_with(context, code, naming_engine(error, engine, "request", fleet))
