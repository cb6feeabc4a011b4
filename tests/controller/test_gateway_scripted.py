"""The gateway against engines that do what the bundled sim engine cannot on demand: serve
LoRA adapters, serve Embed, Classify and Score, fail a Generate at a chosen point, report a
chosen load. Real gRPC all the way: a real controller in front of `ScriptedEngine`s, each a
real sim engine behind a thin OpenEngine server (see ScriptedServicer). Covers LoRA fan-out
results, task routing by capability, retries before the first token and the single terminal
error after it, GetLoad's sums and per-engine detail, and Abort of every request when no
engine can be reached."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import grpc
import pytest
from typer.testing import CliRunner, Result

from controller.outcomes import ENGINE_METADATA_KEY, read_outcomes
from controller.registry import EngineState
from kvplane.cli import app as kvplane_cli
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    ServedEngine,
    close_fleet,
    ended_while_queued,
    engines_of_kinds,
    generate_request,
    make_fleet,
)
from tests.controller.fronted_engine import Forwarding, FrontedEngine, start_fronted_engine
from tests.partial_servicers import PartialVllmGenerate
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]
EMBED_DIMENSION = 4
T = TypeVar("T")


@dataclass
class GenerateFaults:
    """Failures the next Generate calls take, whichever engine receives them (shared by the
    engines of a fleet, so a test needs not know where the router sends a request):
    - "unavailable": refused before acceptance with UNAVAILABLE (no event);
    - "unauthenticated": refused before acceptance with UNAUTHENTICATED, as an engine run
      with `auth` refuses a controller whose `engine_token_file` it no longer takes;
    - "overloaded": accepted, then one retryable terminal EngineError (OVERLOADED);
    - "invalid": accepted, then one non-retryable terminal EngineError;
    - "model_not_found": accepted, then one non-retryable terminal EngineError
      MODEL_NOT_FOUND (something the request names other than its LoRA adapter is gone);
    - "session_ended": a decode request's KV session ended on its prefill engine first (an
      operator's Abort of it there), then the sim engine's (which finds no session);
    - "token_then_error": the first token, then one retryable terminal EngineError;
    - "token_then_unavailable": the first token, then the call fails with UNAVAILABLE;
    - "token_then_error_then_internal": "token_then_error", then the call fails with INTERNAL;
    - "finished_then_internal": the whole stream, then the call fails with INTERNAL;
    - "finished_then_unavailable": the first sequence's end, then the call fails with
      UNAVAILABLE (a request for several sequences: the others not ended);
    - "prompt_then_error", "prompt_then_unavailable": as the "token_" ones, after the
      prompt's output (a request asking for prompt logprobs), before any token;
    - on `vllm.Generate` (ScriptedVllm): "prompt_info_then_unavailable", a vLLM server's
      first response (its `prompt_info` alone), then the call fails with UNAVAILABLE;
      "prompt_info_then_end", that response alone, then the stream ends OK;
      "output_then_unavailable", the first output, then the call fails with UNAVAILABLE.
    """

    pending: list[str] = field(default_factory=list)


async def passed_on(stream: AsyncIterable[T], context: Context) -> AsyncIterator[T]:
    """The sim engine's `stream`, its status passed on as the engine said it."""
    try:
        async for response in stream:
            yield response
    except grpc.aio.AioRpcError as refused:
        await context.abort(refused.code(), refused.details() or "")


async def _end_session(session: pb.KvSessionRef) -> None:
    """Abort `session` on the engine holding it (its first endpoint), as an operator would."""
    endpoint = session.endpoints[0]
    async with grpc.aio.insecure_channel(f"{endpoint.host}:{endpoint.port}") as holder:
        await pb_grpc.OpenEngineStub(holder).Abort(pb.AbortRequest(kv_session=session))


class ReportsLoad(Forwarding):
    """GetLoad is the sim engine's with the figures in `load` (None: the field absent)."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.load: dict[str, int | None] = {}

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        reply = await self.inner.GetLoad(request)
        for name, value in self.load.items():
            if value is None:
                reply.ClearField(name)  # type: ignore[arg-type]
            else:
                setattr(reply, name, value)
        return reply


class ScriptedServicer(ReportsLoad):
    """A sim engine with the capabilities the test gives it, faithful to the seed's rules
    where it answers itself (WIRE.md section 3):

    - GetModelInfo is the sim engine's, with `supports_lora` set as asked (None: absent) and
      `tasks.<task>.supported` for each of `tasks` ("embed", "classify", "score").
    - LoRA (`lora_enabled`): a positive id, a non-empty name and an absolute directory, else
      INVALID_ARGUMENT; the same triple twice is idempotent (`already_loaded`); a conflicting
      id, name or path is ALREADY_EXISTS; unloading an unknown name is NOT_FOUND; with LoRA
      disabled every LoRA call is FAILED_PRECONDITION. While `list_loras_gate` is set and
      not open, ListLoras waits for it, having set `list_loras_waiting`.
    - Embed, Classify, Score (each when in `tasks`, else FAILED_PRECONDITION): one output per
      input (Score: per group, one per candidate), in request order, the index present even
      for 0; an unknown model is NOT_FOUND, a `lora_name` is refused as Generate's. While
      `task_gate` is set and not open, each accepted task waits for it: Abort of its id
      ends it CANCELLED (as the bundled engine ends an aborted task, in its words), and a
      task whose call is cancelled is recorded in `tasks_cancelled`. While `task_arrival`
      is set and not open, each task waits for it before it is accepted (as a call on its
      way: Abort of its id is the sim engine's NOT_FOUND), recorded in `tasks_arrived`.
    - Generate takes the next of the shared GenerateFaults, else is the sim engine's. One
      naming a LoRA adapter is refused as the seed says (LoRA disabled: FAILED_PRECONDITION;
      an adapter not loaded here: NOT_FOUND), else runs as the sim engine's without it (the
      sim's dummy weights have nothing for an adapter to change).

    - GetLoad is the sim engine's with the figures the test sets in `load` (ReportsLoad).

    Everything else (info, health, KV events, abort of other ids) is the sim engine's answer.
    """

    def __init__(
        self,
        inner: pb_grpc.OpenEngineAsyncStub,
        faults: GenerateFaults,
        *,
        advertise_lora: bool | None,
        lora_enabled: bool,
        tasks: frozenset[str],
    ) -> None:
        super().__init__(inner)
        self.faults = faults
        self.advertise_lora = advertise_lora
        self.lora_enabled = lora_enabled
        self.tasks = tasks
        self.adapters: dict[str, pb.LoraAdapter] = {}
        self.generate_calls: list[str] = []
        self.task_calls: list[str] = []
        self.task_gate: asyncio.Event | None = None
        self.held_tasks: dict[str, asyncio.Event] = {}  # request id -> set when aborted
        self.tasks_cancelled: list[str] = []
        self.task_arrival: asyncio.Event | None = None
        self.tasks_arrived: list[str] = []
        self.list_loras_gate: asyncio.Event | None = None
        self.list_loras_waiting = asyncio.Event()

    # ---- what the test gives it ----

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        info = await self.inner.GetModelInfo(request)
        if self.advertise_lora is None:
            info.ClearField("supports_lora")
        else:
            info.supports_lora = self.advertise_lora
        info.tasks.embed.supported = "embed" in self.tasks
        if "embed" in self.tasks:
            info.tasks.embed.dimension = EMBED_DIMENSION
        info.tasks.classify.supported = "classify" in self.tasks
        info.tasks.score.supported = "score" in self.tasks
        return info

    # ---- Generate, with faults ----

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.generate_calls.append(request.request_id)
        if request.lora_name:
            request = await self._without_lora(request, context)
        fault = self.faults.pending.pop(0) if self.faults.pending else None
        if fault == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: not now")
        if fault == "unauthenticated":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "scripted: not the token")
        if fault == "session_ended":
            await _end_session(request.kv.session)
        if fault in ("overloaded", "invalid", "model_not_found"):
            code = {
                "overloaded": pb.ERROR_CODE_OVERLOADED,
                "invalid": pb.ERROR_CODE_INTERNAL,
                "model_not_found": pb.ERROR_CODE_MODEL_NOT_FOUND,
            }[fault]
            yield pb.GenerateResponse(
                request_id=request.request_id,
                error=pb.EngineError(
                    code=code, message=f"scripted: {fault}", retryable=fault == "overloaded"
                ),
            )
            return
        # The event after which the fault strikes, and what it does then.
        after, _, then = (fault or "").partition("_then_")
        call = self.inner.Generate(request)
        try:
            async for response in passed_on(call, context):
                yield response
                if response.WhichOneof("event") != after:
                    continue
                if then.startswith("error"):
                    yield pb.GenerateResponse(
                        request_id=request.request_id,
                        error=pb.EngineError(
                            code=pb.ERROR_CODE_OVERLOADED,
                            message=f"scripted: {after}_then_error",
                            retryable=True,
                        ),
                    )
                    break
                if then == "unavailable":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: gone")
            if then.endswith("internal"):
                await context.abort(grpc.StatusCode.INTERNAL, "scripted: broke after the end")
        finally:
            call.cancel()

    # ---- LoRA ----

    async def _lora_allowed(self, context: Context) -> None:
        if not self.lora_enabled:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is disabled")

    async def _without_lora(
        self, request: pb.GenerateRequest, context: Context
    ) -> pb.GenerateRequest:
        await self._lora_allowed(context)
        if request.lora_name not in self.adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter {request.lora_name!r}")
        plain = pb.GenerateRequest()
        plain.CopyFrom(request)
        plain.lora_name = ""
        return plain

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Context) -> Any:
        await self._lora_allowed(context)
        a = request.adapter
        if a.lora_id <= 0 or not a.lora_name or not Path(a.source_path).is_absolute():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a positive lora_id, a name and an absolute source_path are required",
            )
        same = self.adapters.get(a.lora_name)
        if same == a:
            return pb.LoadLoraResponse(adapter=a, already_loaded=True)
        if same is not None or any(
            b.lora_id == a.lora_id or b.source_path == a.source_path for b in self.adapters.values()
        ):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "conflicts with a loaded adapter")
        self.adapters[a.lora_name] = a
        return pb.LoadLoraResponse(adapter=a, already_loaded=False)

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: Context) -> Any:
        await self._lora_allowed(context)
        adapter = self.adapters.pop(request.lora_name, None)
        if adapter is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter {request.lora_name!r}")
        return pb.UnloadLoraResponse(adapter=adapter)

    async def ListLoras(self, request: pb.ListLorasRequest, context: Context) -> Any:
        await self._lora_allowed(context)
        if self.list_loras_gate is not None:
            self.list_loras_waiting.set()
            await self.list_loras_gate.wait()
        return pb.ListLorasResponse(
            adapters=sorted(self.adapters.values(), key=lambda a: a.lora_id)
        )

    # ---- tasks ----

    async def _task(
        self, task: str, request_context: pb.TaskRequestContext, context: Context
    ) -> None:
        self.task_calls.append(task)
        request_id = request_context.request_id
        if self.task_arrival is not None:
            self.tasks_arrived.append(request_id)
            try:
                await self.task_arrival.wait()
            except asyncio.CancelledError:
                self.tasks_cancelled.append(request_id)
                raise
        if task not in self.tasks:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{task} is unsupported")
        if request_context.model not in ("", "sim"):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no model {request_context.model!r}")
        if request_context.lora_name:  # as a Generate naming an adapter is refused
            await self._lora_allowed(context)
            if request_context.lora_name not in self.adapters:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"no adapter {request_context.lora_name!r}"
                )
        gate = self.task_gate
        if gate is None:
            return
        aborted = self.held_tasks[request_context.request_id] = asyncio.Event()
        try:
            opened = asyncio.ensure_future(gate.wait())
            stopped = asyncio.ensure_future(aborted.wait())
            try:
                await asyncio.wait((opened, stopped), return_when=asyncio.FIRST_COMPLETED)
            finally:
                opened.cancel()
                stopped.cancel()
        except asyncio.CancelledError:
            self.tasks_cancelled.append(request_context.request_id)
            raise
        finally:
            del self.held_tasks[request_context.request_id]
        if aborted.is_set():
            await context.abort(grpc.StatusCode.CANCELLED, f"request {request_id!r} was aborted")

    async def Abort(self, request: pb.AbortRequest, context: Context) -> Any:
        held = self.held_tasks.get(request.request_id) if request.request_id else None
        if held is None:
            try:
                return await self.inner.Abort(request)
            except grpc.aio.AioRpcError as exc:  # the sim engine's status, as it answered
                await context.abort(exc.code(), exc.details() or "")
        held.set()
        return pb.AbortResponse(status=pb.ABORT_STATUS_ABORTED, message="aborted")

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> Any:
        await self._task("embed", request.context, context)
        outputs = []
        for index, item in enumerate(request.inputs):
            ids = list(item.token_ids.ids)
            values = [float(sum(ids) % (k + 7)) for k in range(EMBED_DIMENSION)]
            outputs.append(
                pb.EmbeddingOutput(
                    item_id=item.item_id,
                    input_index=index,
                    granularity=pb.TASK_OUTPUT_GRANULARITY_SEQUENCE,
                    dense=pb.DenseFloatTensor(shape=[EMBED_DIMENSION], values=values),
                )
            )
        usage = pb.TaskUsage(input_tokens=sum(len(i.token_ids.ids) for i in request.inputs))
        return pb.EmbedResponse(request_id=request.context.request_id, outputs=outputs, usage=usage)

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> Any:
        await self._task("classify", request.context, context)
        outputs = [
            pb.ClassificationOutput(
                item_id=item.item_id,
                input_index=index,
                granularity=pb.TASK_OUTPUT_GRANULARITY_SEQUENCE,
                scores=pb.DenseFloatTensor(shape=[1], values=[float(len(item.token_ids.ids))]),
            )
            for index, item in enumerate(request.inputs)
        ]
        return pb.ClassifyResponse(request_id=request.context.request_id, outputs=outputs)

    async def Score(self, request: pb.ScoreRequest, context: Context) -> Any:
        await self._task("score", request.context, context)
        groups = [
            pb.ScoreGroupOutput(
                group_id=group.group_id,
                group_index=g,
                candidates=[
                    pb.ScoreCandidateOutput(
                        candidate_id=c.item_id,
                        candidate_index=k,
                        scores=pb.DenseFloatTensor(shape=[1], values=[float(k)]),
                    )
                    for k, c in enumerate(group.candidates)
                ],
            )
            for g, group in enumerate(request.groups)
        ]
        return pb.ScoreResponse(request_id=request.context.request_id, groups=groups)


class ScriptedVllm(PartialVllmGenerate):
    """`vllm.Generate`'s GenerateStream beside a ScriptedServicer, streamed as a vLLM server
    streams it: its first response carries `prompt_info` alone, before any token (the
    bundled engine sends it with its first token); then the sim engine's stream. Each call
    is recorded with the engine's Generate calls, and takes the next of its GenerateFaults
    ("prompt_info_then_unavailable", "prompt_info_then_end", "output_then_unavailable")."""

    def __init__(self, inner: vpb_grpc.GenerateAsyncStub, engine: ScriptedServicer) -> None:
        self.inner = inner
        self.engine = engine

    async def GenerateStream(
        self, request: vpb.GenerateRequest, context: Context
    ) -> AsyncIterator[vpb.GenerateResponse]:
        self.engine.generate_calls.append(request.request_id)
        faults = self.engine.faults.pending
        fault = faults.pop(0) if faults else None
        call = self.inner.GenerateStream(request)
        try:
            async for response in call:
                if response.HasField("prompt_info"):
                    yield vpb.GenerateResponse(prompt_info=response.prompt_info)
                    if fault == "prompt_info_then_unavailable":
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: gone")
                    if fault == "prompt_info_then_end":
                        return
                    response.ClearField("prompt_info")
                yield response
                if fault == "output_then_unavailable" and response.HasField("outputs"):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: gone")
        finally:
            call.cancel()


def serve_vllm(engine: ScriptedServicer, server: grpc.aio.Server, inner: grpc.aio.Channel) -> None:
    """`start_fronted_engine`'s `serve_also`: ScriptedVllm on the front server."""
    vpb_grpc.add_GenerateServicer_to_server(
        ScriptedVllm(vpb_grpc.GenerateStub(inner), engine), server
    )


ScriptedEngine = FrontedEngine[ScriptedServicer]


async def start_scripted_engine(
    name: str,
    faults: GenerateFaults | None = None,
    *,
    advertise_lora: bool | None = False,
    lora_enabled: bool = False,
    tasks: frozenset[str] = frozenset(),
    time_scale: float = 0.0,
    vllm: bool = False,
) -> ScriptedEngine:
    """`vllm`: it serves `vllm.Generate` too (ScriptedVllm)."""
    return await start_fronted_engine(
        name,
        lambda inner: ScriptedServicer(
            inner,
            faults or GenerateFaults(),
            advertise_lora=advertise_lora,
            lora_enabled=lora_enabled,
            tasks=tasks,
        ),
        time_scale,
        serve_also=serve_vllm if vllm else None,
    )


ScriptedFleet = EngineFleet[ScriptedEngine]


async def scripted_fleet(*engines: ScriptedEngine, **controller: Any) -> ScriptedFleet:
    fleet: ScriptedFleet = await make_fleet(engines=list(engines), **controller)
    return fleet


def address(engine: ServedEngine) -> str:
    return f"127.0.0.1:{engine.port}"


def outcomes(metadata: Any) -> dict[str, dict[str, Any]]:
    """The gateway's per-engine outcomes in a call's trailing metadata, by instance id."""
    return {e["instance_id"]: e for e in read_outcomes(metadata)}


async def cli(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, kvplane_cli, ["admin", *args])


# ---- LoRA ----


async def test_lora_fan_out_aggregates_every_engines_result(tmp_path: Path) -> None:
    """e0, e1 serve LoRA; e2 says supports_lora false and is never asked."""
    engines = [
        await start_scripted_engine("e0", advertise_lora=True, lora_enabled=True),
        await start_scripted_engine("e1", advertise_lora=True, lora_enabled=True),
        await start_scripted_engine("e2", advertise_lora=False),
    ]
    fleet = await scripted_fleet(*engines)
    try:
        x = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=str(tmp_path / "x"))
        call = fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        loaded = await call
        assert (loaded.adapter, loaded.already_loaded) == (x, False)
        report = outcomes(await call.trailing_metadata())
        assert {k: v["outcome"] for k, v in report.items()} == {
            "e0": "ok", "e1": "ok", "e2": "skipped",
        }  # fmt: skip
        assert report["e0"]["adapters"] == ["x"]
        assert all(e.servicer.adapters == {"x": x} for e in engines[:2])
        assert engines[2].servicer.adapters == {}
        again = await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        assert again.already_loaded

        # Another adapter under x's id: each engine refuses it, and says so.
        conflicting = pb.LoraAdapter(lora_id=1, lora_name="x2", source_path=str(tmp_path / "2"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=conflicting))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert {
            v["outcome"] for k, v in outcomes(err.value.trailing_metadata()).items() if k != "e2"
        } == {"ALREADY_EXISTS"}
        # Another adapter under x's name: the controller, which loaded x, refuses it itself.
        renamed = pb.LoraAdapter(lora_id=2, lora_name="x", source_path=x.source_path)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=renamed))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "loaded through this controller" in (err.value.details() or "")
        assert all(e.servicer.adapters == {"x": x} for e in engines[:2])

        # Loaded on one engine only, behind the controller's back (another client of e0).
        y = pb.LoraAdapter(lora_id=3, lora_name="y", source_path=str(tmp_path / "y"))
        async with grpc.aio.insecure_channel(address(engines[0])) as direct:
            await pb_grpc.OpenEngineStub(direct).LoadLora(pb.LoadLoraRequest(adapter=y))
        listing = fleet.gateway.ListLoras(pb.ListLorasRequest())
        listed = await listing
        assert [a.lora_name for a in listed.adapters] == ["x", "y"]
        held = {
            k: v.get("adapters") for k, v in outcomes(await listing.trailing_metadata()).items()
        }
        assert held == {"e0": ["x", "y"], "e1": ["x"], "e2": None}

        unload = fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="y"))
        assert (await unload).adapter == y
        assert {k: v["outcome"] for k, v in outcomes(await unload.trailing_metadata()).items()} == {
            "e0": "ok", "e1": "not_loaded", "e2": "skipped",
        }  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="y"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # loaded nowhere now
    finally:
        await close_fleet(fleet)


async def test_the_fleets_model_info_says_lora_is_supported_when_an_engine_supports_it() -> None:
    """The gateway takes `lora_name` (routed to an engine holding the adapter) and the LoRA
    calls (fanned out to the engines that support LoRA) when any engine does: its ModelInfo
    says `supports_lora`, whichever engine answers (e0, without LoRA, answered false), and
    while e1 is out of routing too: the fleet view (on which a controller fronting this one
    reads the model's facts again) does not move with a cordon, and an upper controller that
    read the answer then would never have routed an adapter here after the uncordon."""
    engines = [
        await start_scripted_engine("e0", advertise_lora=False),
        await start_scripted_engine("e1", advertise_lora=True, lora_enabled=True),
    ]
    fleet = await scripted_fleet(*engines)
    try:
        request = pb.GetModelInfoRequest(model="sim")
        async with grpc.aio.insecure_channel(address(engines[0])) as direct:
            answered = await pb_grpc.OpenEngineStub(direct).GetModelInfo(request)
        assert answered.HasField("supports_lora") and not answered.supports_lora
        for _ in range(2):  # whichever engine answers
            assert (await fleet.gateway.GetModelInfo(request)).supports_lora
        await fleet.admin.Cordon(apb.EngineRef(engine="e1"))
        assert (await fleet.gateway.GetModelInfo(request)).supports_lora
    finally:
        await close_fleet(fleet)


async def test_lora_cli_load_on_one_engine_then_unload_from_the_fleet(tmp_path: Path) -> None:
    """The issue's sequence: `lora load x ... --engine e0`, then `lora unload x` on the
    controller succeeds though e1 never had x."""
    engines = [
        await start_scripted_engine("e0", advertise_lora=True, lora_enabled=True),
        await start_scripted_engine("e1", advertise_lora=True, lora_enabled=True),
    ]
    fleet = await scripted_fleet(*engines)
    try:
        t = ["--target", fleet.target]
        path = str(tmp_path / "x")
        loaded = await cli("lora", "load", "x", path, "--id", "1", "--engine", "e0", *t)
        assert loaded.exit_code == 0, loaded.output
        assert list(engines[0].servicer.adapters) == ["x"] and not engines[1].servicer.adapters
        listed = await cli("lora", "list", *t, "--output", "json")
        assert listed.exit_code == 0, listed.output
        doc = json.loads(listed.stdout)
        assert [a["lora_name"] for a in doc["adapters"]] == ["x"]
        held = {e["instance_id"]: e["adapters"] for e in doc["engines"]}
        assert held == {"e0": ["x"], "e1": []}  # which engine holds what
        table = await cli("lora", "list", *t)
        assert table.exit_code == 0, table.output
        header, row = table.stdout.splitlines()
        assert header.split() == ["ID", "NAME", "PATH", "ENGINES"]
        assert row.split() == ["1", "x", path, "e0"]
        unloaded = await cli("lora", "unload", "x", *t)
        assert unloaded.exit_code == 0, unloaded.output
        assert not engines[0].servicer.adapters
        lines = unloaded.stdout.splitlines()
        assert lines[0] == "x unloaded"
        # "  e1 (127.0.0.1:PORT): not_loaded, no adapter 'x'": one line per engine.
        outcome = {line.split()[0]: line.split("): ")[1].split(",")[0] for line in lines[1:]}
        assert outcome == {"e0": "ok", "e1": "not_loaded"}
    finally:
        await close_fleet(fleet)


async def test_lora_list_fails_with_the_engines_status() -> None:
    """e0 does not say whether it supports LoRA (so it is asked) and has it disabled: the
    fleet's list is not an empty success but the engine's FAILED_PRECONDITION, by name."""
    engines = [
        await start_scripted_engine("e0", advertise_lora=None, lora_enabled=False),
        await start_scripted_engine("e1", advertise_lora=True, lora_enabled=True),
    ]
    fleet = await scripted_fleet(*engines)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.ListLoras(pb.ListLorasRequest())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"{address(engines[0])}: FAILED_PRECONDITION" in (err.value.details() or "")
        report = outcomes(err.value.trailing_metadata())
        assert (report["e0"]["outcome"], report["e1"]["outcome"]) == ("FAILED_PRECONDITION", "ok")
        listed = await cli("lora", "list", "--target", fleet.target)
        assert listed.exit_code != 0
        assert "FAILED_PRECONDITION" in str(listed.exception)
    finally:
        await close_fleet(fleet)


# ---- tasks ----


async def test_tasks_go_only_to_engines_that_support_them() -> None:
    engines = [
        await start_scripted_engine("e0"),
        await start_scripted_engine("e1", tasks=frozenset({"embed"})),
        await start_scripted_engine("e2"),
    ]
    fleet = await scripted_fleet(*engines)
    try:
        inputs = [
            pb.TaskInput(item_id=f"i{k}", token_ids=pb.TokenIds(ids=[k, 5])) for k in range(3)
        ]

        def embed(request_id: str, model: str = "sim") -> pb.EmbedRequest:
            context = pb.TaskRequestContext(request_id=request_id, model=model)
            return pb.EmbedRequest(context=context, inputs=inputs)

        async with grpc.aio.insecure_channel(address(engines[1])) as direct:
            expected = await pb_grpc.OpenEngineStub(direct).Embed(embed("r0"))
        for i in range(5):
            got = await fleet.gateway.Embed(embed(f"r{i}"))
            expected.request_id = f"r{i}"
            assert got == expected
            assert [o.input_index for o in got.outputs] == [0, 1, 2]
            assert got.outputs[0].HasField("input_index")
        assert engines[1].servicer.task_calls == ["embed"] * 6
        assert engines[0].servicer.task_calls == engines[2].servicer.task_calls == []

        unsupported = pb.TaskRequestContext(request_id="u", model="sim")
        for rpc in (
            fleet.gateway.Classify(pb.ClassifyRequest(context=unsupported, inputs=inputs)),
            fleet.gateway.Score(pb.ScoreRequest(context=unsupported)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Embed(embed("unknown", model="no-such-model"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert all("classify" not in e.servicer.task_calls for e in engines)

        # The only embed engine takes no traffic: unavailable, not unsupported, and why.
        await fleet.admin.Cordon(apb.EngineRef(engine="e1"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Embed(embed("cordoned"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        reason, _, engines_said = (err.value.details() or "").partition(": ")
        assert reason == "no embed engine takes traffic now"
        assert sorted(engines_said.split(", ")) == ["e0 no embed", "e1 cordoned", "e2 no embed"]
        # An engine never reached may have the task: named by its state, not "no embed".
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=dead))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Embed(embed("unreached"))
        said = (err.value.details() or "").partition(": ")[2].split(", ")
        assert [e for e in said if e.startswith(dead)] in (
            [f"{dead} unknown"],
            [f"{dead} unreachable"],
        )
    finally:
        await close_fleet(fleet)


async def test_a_running_task_is_aborted_by_id_and_stopped_by_its_clients_cancel() -> None:
    """Seed: task ids share generation's namespace and abort semantics, and a client's
    cancellation stops the work. A running Classify's id is ALREADY_EXISTS for a Generate;
    Abort of it reaches the engine running it (ABORTED; the call ends CANCELLED in the
    engine's words, not as an engine failure: it read "engine ADDRESS failed the request:
    CANCELLED: ..."), then ALREADY_FINISHED; a client cancelling its Classify cancels the
    engine's call."""
    engines = [
        await start_scripted_engine("e0"),
        await start_scripted_engine("e1", tasks=frozenset({"classify"})),
    ]
    fleet = await scripted_fleet(*engines)
    capable = engines[1].servicer
    capable.task_gate = asyncio.Event()
    inputs = [pb.TaskInput(item_id="i", token_ids=pb.TokenIds(ids=[1, 5]))]

    def classify(request_id: str) -> grpc.aio.UnaryUnaryCall[Any, pb.ClassifyResponse]:
        context = pb.TaskRequestContext(request_id=request_id, model="sim")
        return fleet.gateway.Classify(pb.ClassifyRequest(context=context, inputs=inputs))

    async def held(request_id: str) -> bool:
        return request_id in capable.held_tasks

    try:
        first = classify("t1")
        await eventually(lambda: held("t1"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in fleet.gateway.Generate(generate_request("t1", [1, 2, 3]))]
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="t1"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await first
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert err.value.details() == "request 't1' was aborted"
        again = await fleet.gateway.Abort(pb.AbortRequest(request_id="t1"))
        assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED

        second = classify("t2")
        await eventually(lambda: held("t2"))
        second.cancel()

        async def cancelled_on_the_engine() -> bool:
            return capable.tasks_cancelled == ["t2"]

        await eventually(cancelled_on_the_engine)
        await eventually(lambda: fleet.app.gateway.relay.running == set())
    finally:
        await close_fleet(fleet)


async def test_an_abort_of_a_task_its_engine_has_not_accepted_yet_ends_it() -> None:
    """An Abort between routing and the engine's acceptance of an Embed: the engine answers
    NOT_FOUND (it has no such task yet), so the gateway ends the task itself, as a Generate:
    ABORTED, its call to the engine cancelled, the task ended as an engine ends an aborted
    one (CANCELLED, the engine's words). The Abort used to answer NOT_FOUND, and the task
    ran to its end once the engine took it."""
    engine = await start_scripted_engine("e0", tasks=frozenset({"embed"}))
    fleet = await scripted_fleet(engine)
    late = engine.servicer
    late.task_arrival = asyncio.Event()
    inputs = [pb.TaskInput(item_id="i", token_ids=pb.TokenIds(ids=[1, 5]))]
    context = pb.TaskRequestContext(request_id="t", model="sim")
    try:
        embedding = fleet.gateway.Embed(pb.EmbedRequest(context=context, inputs=inputs))

        async def arrived() -> bool:
            return late.tasks_arrived == ["t"]

        await eventually(arrived)
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="t"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await embedding
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert err.value.details() == "request 't' was aborted"

        async def cancelled_on_the_engine() -> bool:
            return late.tasks_cancelled == ["t"]

        await eventually(cancelled_on_the_engine)
        await eventually(lambda: fleet.app.gateway.relay.running == set())
        again = await fleet.gateway.Abort(pb.AbortRequest(request_id="t"))
        assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED
    finally:
        late.task_arrival.set()
        await close_fleet(fleet)


async def test_a_task_naming_a_lora_adapter_goes_to_an_engine_holding_it(tmp_path: Path) -> None:
    """Seed: a task's `lora_name` selects a loaded adapter. Both engines embed and serve
    LoRA, only e1 holds x (loaded through the gateway, `kvplane-engine: e1`): every Embed
    naming x goes to e1 (the least loaded pick sent some to e0, which refused NOT_FOUND); an
    adapter no embed engine holds is NOT_FOUND, as for a Generate, before any engine."""
    engines = [
        await start_scripted_engine(
            f"e{i}", advertise_lora=True, lora_enabled=True, tasks=frozenset({"embed"})
        )
        for i in range(2)
    ]
    fleet = await scripted_fleet(*engines)
    try:
        x = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=str(tmp_path / "x"))
        await fleet.gateway.LoadLora(
            pb.LoadLoraRequest(adapter=x), metadata=((ENGINE_METADATA_KEY, "e1"),)
        )
        inputs = [pb.TaskInput(item_id="i", token_ids=pb.TokenIds(ids=[1, 5]))]
        for i in range(4):
            context = pb.TaskRequestContext(request_id=f"r{i}", model="sim", lora_name="x")
            await fleet.gateway.Embed(pb.EmbedRequest(context=context, inputs=inputs))
        assert [len(e.servicer.task_calls) for e in engines] == [0, 4]
        nope = pb.TaskRequestContext(request_id="n", model="sim", lora_name="nope")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Embed(pb.EmbedRequest(context=nope, inputs=inputs))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == "no embed engine has LoRA adapter 'nope' loaded"
        assert [len(e.servicer.task_calls) for e in engines] == [0, 4]
    finally:
        await close_fleet(fleet)


def task_call(
    gateway: pb_grpc.OpenEngineAsyncStub, task: str, request_id: str, lora_name: str
) -> Any:
    """The gateway's `task` call (Embed, Classify or Score) for one input, naming `lora_name`."""
    context = pb.TaskRequestContext(request_id=request_id, model="sim", lora_name=lora_name)
    item = pb.TaskInput(item_id="i", token_ids=pb.TokenIds(ids=[1, 5]))
    if task == "embed":
        return gateway.Embed(pb.EmbedRequest(context=context, inputs=[item]))
    if task == "classify":
        return gateway.Classify(pb.ClassifyRequest(context=context, inputs=[item]))
    group = pb.ScoreGroup(group_id="g", query=item, candidates=[item])
    return gateway.Score(pb.ScoreRequest(context=context, groups=[group]))


async def e0_first_lora_fleet(
    tasks: frozenset[str],
) -> tuple[list[ScriptedEngine], ScriptedFleet]:
    """Two engines serving LoRA and `tasks`; e1 reports running requests (read by the
    controller before this returns), so e0 is each task's first pick."""
    engines = [
        await start_scripted_engine(f"e{i}", advertise_lora=True, lora_enabled=True, tasks=tasks)
        for i in range(2)
    ]
    engines[1].servicer.load = {"running_requests": 3}
    fleet = await scripted_fleet(*engines)
    registry = fleet.app.controller.fleet.registry
    try:
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address(engines[1])).load.running_requests == 3, 15
        )
    except BaseException:
        await close_fleet(fleet)
        raise
    return engines, fleet


async def test_a_task_whose_engine_lost_its_adapter_goes_to_one_holding_it(
    tmp_path: Path,
) -> None:
    """x is loaded on e0 and e1 through the gateway; e1 reports running requests, so e0 is
    each task's first pick. x is then unloaded on e0 behind the controller's back: an Embed,
    a Classify and a Score naming x are each refused there (NOT_FOUND), the gateway reads
    e0's adapters again and runs the task on e1. Once x is gone from both, a task naming it
    is NOT_FOUND as the fleet says ("no embed engine has LoRA adapter 'x' loaded"), not the
    engine's bare refusal."""
    tasks = ("embed", "classify", "score")
    engines, fleet = await e0_first_lora_fleet(frozenset(tasks))
    registry = fleet.app.controller.fleet.registry
    x = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=str(tmp_path / "x"))
    try:
        for task in tasks:
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
            del engines[0].servicer.adapters["x"]
            calls = [len(e.servicer.task_calls) for e in engines]
            await task_call(fleet.gateway, task, f"moved-{task}", "x")
            assert [
                len(e.servicer.task_calls) - n for e, n in zip(engines, calls, strict=True)
            ] == [1, 1]
            assert not registry.get(address(engines[0])).holds_lora("x")
        for task in tasks:
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
            for engine in engines:
                del engine.servicer.adapters["x"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await task_call(fleet.gateway, task, f"nowhere-{task}", "x")
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.NOT_FOUND,
                f"no {task} engine has LoRA adapter 'x' loaded",
            )
    finally:
        await close_fleet(fleet)


async def test_an_abort_of_a_task_between_its_two_engines_ends_it(tmp_path: Path) -> None:
    """An Embed naming x is refused by e0 (x unloaded there behind the controller's back):
    while the gateway reads e0's adapters again before sending the task to e1, no engine
    holds the task, so an Abort of it is the gateway's to carry out: ABORTED, and the task
    ends as an engine ends an aborted one (CANCELLED), e1 never called. The Abort went to e0,
    which answered NOT_FOUND, and the task then ran on e1 to its end."""
    engines, fleet = await e0_first_lora_fleet(frozenset({"embed"}))
    x = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=str(tmp_path / "x"))
    try:
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        first = engines[0].servicer
        del first.adapters["x"]
        first.list_loras_gate = asyncio.Event()
        embed = task_call(fleet.gateway, "embed", "t", "x")
        await asyncio.wait_for(first.list_loras_waiting.wait(), 15)
        assert first.task_calls == ["embed"]
        aborted = await fleet.gateway.Abort(pb.AbortRequest(request_id="t"))
        assert aborted.status == pb.ABORT_STATUS_ABORTED
        first.list_loras_gate.set()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await embed
        assert (err.value.code(), err.value.details()) == (
            grpc.StatusCode.CANCELLED,
            "request 't' was aborted",
        )
        assert engines[1].servicer.task_calls == []
    finally:
        await close_fleet(fleet)


async def test_classify_and_score_go_to_the_engines_that_support_them() -> None:
    """e0 classifies, e1 scores, e2 does neither: each task reaches only its engine, and the
    engine's reply comes back unchanged."""
    engines = [
        await start_scripted_engine("e0", tasks=frozenset({"classify"})),
        await start_scripted_engine("e1", tasks=frozenset({"score"})),
        await start_scripted_engine("e2"),
    ]
    fleet = await scripted_fleet(*engines)
    try:
        inputs = [pb.TaskInput(item_id=f"i{k}", token_ids=pb.TokenIds(ids=[5] * k)) for k in (1, 3)]
        classify = pb.ClassifyRequest(
            context=pb.TaskRequestContext(request_id="c", model="sim"), inputs=inputs
        )
        score = pb.ScoreRequest(
            context=pb.TaskRequestContext(request_id="s", model="sim"),
            groups=[pb.ScoreGroup(group_id="g", query=inputs[0], candidates=inputs)],
        )
        async with grpc.aio.insecure_channel(address(engines[0])) as direct:
            classified = await pb_grpc.OpenEngineStub(direct).Classify(classify)
        async with grpc.aio.insecure_channel(address(engines[1])) as direct:
            scored = await pb_grpc.OpenEngineStub(direct).Score(score)
        for _ in range(3):
            assert await fleet.gateway.Classify(classify) == classified
            assert await fleet.gateway.Score(score) == scored
        assert [o.scores.values[0] for o in classified.outputs] == [1.0, 3.0]
        assert [c.candidate_id for c in scored.groups[0].candidates] == ["i1", "i3"]
        calls = [e.servicer.task_calls for e in engines]
        assert calls == [["classify"] * 4, ["score"] * 4, []]
    finally:
        await close_fleet(fleet)


async def test_a_task_goes_to_the_least_loaded_engine_that_has_it() -> None:
    """Of two engines with the task, the one reporting running and queued requests is passed
    over for the idle one."""
    engines = [await start_scripted_engine(f"e{i}", tasks=frozenset({"embed"})) for i in range(2)]
    engines[0].servicer.load = {"running_requests": 4, "queued_requests": 3}
    fleet = await scripted_fleet(*engines)
    registry = fleet.app.controller.fleet.registry
    try:
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address(engines[0])).load.running_requests == 4, 15
        )
        for n in range(3):
            await task_call(fleet.gateway, "embed", f"t{n}", "")
        assert [e.servicer.task_calls for e in engines] == [[], ["embed"] * 3]
    finally:
        await close_fleet(fleet)


async def test_a_task_an_engine_served_restarts_its_failure_count() -> None:
    """Outlier ejection counts an engine's failures in a row: a pooling task it served in
    between restarts the count, as a served Generate does, so that two failures around it
    do not eject the fleet's one engine with the task (`eject_after_failures: 2`)."""
    faults = GenerateFaults()
    embedder = await start_scripted_engine("e0", faults, tasks=frozenset({"embed"}))
    other = await start_scripted_engine("e1", faults)
    fleet = await scripted_fleet(
        embedder, other, router={"policy": "round_robin"}, health={"eject_after_failures": 2}
    )
    request_ids = iter(range(100))

    async def generate_on_turn(fault: str | None) -> ScriptedEngine:
        """A Generate (failing by an engine fault of its own, "invalid", when `fault`), where
        the round robin sends it: that engine."""
        faults.pending[:] = [fault] if fault else []
        request_id = f"g{next(request_ids)}"
        [r async for r in fleet.gateway.Generate(generate_request(request_id, [1, 2, 3], 2))]
        return embedder if request_id in embedder.servicer.generate_calls else other

    try:
        while await generate_on_turn(None) is not other:  # the embedder's turn next
            pass
        assert await generate_on_turn("invalid") is embedder  # its first failure
        await task_call(fleet.gateway, "embed", "t0", "")  # served: the count restarts
        assert await generate_on_turn(None) is other
        assert await generate_on_turn("invalid") is embedder  # one failure in a row again
        record = fleet.app.controller.fleet.registry.get(address(embedder))
        assert record.state is EngineState.READY
        await task_call(fleet.gateway, "embed", "t1", "")
        assert embedder.servicer.task_calls == ["embed"] * 2
    finally:
        await close_fleet(fleet)


# ---- Generate: retries and terminal errors ----


async def two_engine_fleet(
    faults: GenerateFaults, *, vllm: bool = False
) -> tuple[ScriptedFleet, list[ScriptedEngine]]:
    engines = [
        await start_scripted_engine("e0", faults, vllm=vllm),
        await start_scripted_engine("e1", faults, vllm=vllm),
    ]
    return await scripted_fleet(*engines), engines


def calls(engines: list[ScriptedEngine], request_id: str) -> int:
    return sum(e.servicer.generate_calls.count(request_id) for e in engines)


@pytest.mark.parametrize("fault", ["unavailable", "overloaded", "unauthenticated"])
async def test_failure_before_the_first_token_is_retried_once_elsewhere(fault: str) -> None:
    """(An engine refusing the controller's token, "unauthenticated", refuses the controller,
    not the request: it was passed to the client as its own error.)"""
    faults = GenerateFaults([fault])
    fleet, engines = await two_engine_fleet(faults)
    try:
        reply = [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3], 4))]
        kinds = [r.WhichOneof("event") for r in reply]
        assert kinds == ["token"] * 4 + ["finished"]  # nothing of the failed attempt leaks
        assert [e.servicer.generate_calls for e in engines] == [["r"], ["r"]]
        metrics = fleet.app.controller.metrics
        assert metrics.retries._value.get() == 1
        assert metrics.requests.labels("ok")._value.get() == 1
        assert len(fleet.app.controller.router.inflight) == 0
        assert fleet.app.gateway.relay.holding == {}
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("fault", ["prompt_then_unavailable", "prompt_then_error"])
async def test_a_failure_after_the_prompts_output_before_a_token_is_retried_elsewhere(
    fault: str,
) -> None:
    """The prompt's output (prompt logprobs) comes before the first token: an engine failing
    after it, a status or a retryable EngineError, failed before the first token, so the
    request is retried elsewhere, and the client gets the prompt's output once, the second
    engine's (it got the failed engine's, then one terminal EngineError)."""
    fleet, engines = await two_engine_fleet(GenerateFaults([fault]))
    try:
        request = generate_request("r", [1, 2, 3], 4)
        request.response.return_prompt_logprobs = True
        reply = [r async for r in fleet.gateway.Generate(request)]
        assert [r.WhichOneof("event") for r in reply] == ["prompt"] + ["token"] * 4 + ["finished"]
        assert calls(engines, "r") == 2
        metrics = fleet.app.controller.metrics
        assert metrics.retries._value.get() == 1
        assert metrics.requests.labels("ok")._value.get() == 1
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


async def test_a_second_failure_after_the_prompts_output_is_one_before_anything_relayed() -> None:
    """With its one retry spent, an engine failing after the prompt's output, before a
    token, ends the request as a failure before anything was relayed: its status, naming
    the engine; the prompt's output held back goes with it."""
    faults = GenerateFaults(["prompt_then_unavailable", "prompt_then_unavailable"])
    fleet, engines = await two_engine_fleet(faults)
    try:
        request = generate_request("r", [1, 2, 3], 4)
        request.response.return_prompt_logprobs = True
        relayed: list[pb.GenerateResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for response in fleet.gateway.Generate(request):
                relayed.append(response)
        assert relayed == []
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed the request: UNAVAILABLE: scripted: gone" in (err.value.details() or "")
        assert calls(engines, "r") == 2
    finally:
        await close_fleet(fleet)


def vllm_request(request_id: str) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=request_id, model="sim", token_ids=vpb.TokenIds(ids=[1, 2, 3]),
        stopping=vpb.StoppingCriteria(max_new_tokens=4, ignore_eos=True),
    )  # fmt: skip


async def test_a_vllm_engine_failing_after_its_prompt_info_is_retried_elsewhere() -> None:
    """A vLLM server's stream begins with a response carrying `prompt_info` alone, before
    any token. An engine failing after it failed before the first token: the request is
    retried on another engine, and the client gets that engine's stream, `prompt_info`
    once (it got the failed engine's `prompt_info`, then UNAVAILABLE)."""
    fleet, engines = await two_engine_fleet(
        GenerateFaults(["prompt_info_then_unavailable"]), vllm=True
    )
    try:
        stub = vpb_grpc.GenerateStub(fleet.channel)
        reply = [r async for r in stub.GenerateStream(vllm_request("v"))]
        assert reply[0].HasField("prompt_info") and not reply[0].HasField("outputs")
        assert reply[0].prompt_info.num_prompt_tokens == 3
        assert not any(r.HasField("prompt_info") for r in reply[1:])
        assert sum(r.outputs.num_tokens for r in reply) == 4
        assert reply[-1].outputs.finish_info.finish_reason == vpb.FinishInfo.LENGTH
        assert calls(engines, "v") == 2
        metrics = fleet.app.controller.metrics
        assert metrics.retries._value.get() == 1
        assert metrics.requests.labels("ok")._value.get() == 1
        assert fleet.app.gateway.relay.holding == {}
    finally:
        await close_fleet(fleet)


async def test_a_vllm_engine_failing_after_its_first_output_passes_the_failure_on() -> None:
    """vllm.Generate has no in-band error: an engine failing once output was relayed (its
    sequence not finished) ends the client's stream with the engine's status, naming the
    engine, not with OK as if the stream were whole; and it is not retried."""
    fleet, engines = await two_engine_fleet(GenerateFaults(["output_then_unavailable"]), vllm=True)
    try:
        stub = vpb_grpc.GenerateStub(fleet.channel)
        request = vllm_request("v")
        request.stopping.max_new_tokens = 50
        reply: list[vpb.GenerateResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for response in stub.GenerateStream(request):
                reply.append(response)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "scripted: gone" in (err.value.details() or "")
        assert any(r.HasField("outputs") for r in reply)
        assert not any(r.outputs.HasField("finish_info") for r in reply)
        assert calls(engines, "v") == 1
        metrics = fleet.app.controller.metrics
        assert metrics.requests.labels("engine_error")._value.get() == 1
    finally:
        await close_fleet(fleet)


async def test_a_vllm_stream_ending_with_its_prompt_info_alone_relays_it() -> None:
    """A stream that ends without a token has what was held for the first token relayed at
    its end, as the engine sent it."""
    engine = await start_scripted_engine("e0", GenerateFaults(["prompt_info_then_end"]), vllm=True)
    fleet = await scripted_fleet(engine)
    try:
        stub = vpb_grpc.GenerateStub(fleet.channel)
        reply = [r async for r in stub.GenerateStream(vllm_request("v"))]
        assert reply == [vpb.GenerateResponse(prompt_info=vpb.PromptInfo(num_prompt_tokens=3))]
        metrics = fleet.app.controller.metrics
        assert metrics.requests.labels("ok")._value.get() == 1
        assert metrics.prompt_tokens._value.get() == 3
    finally:
        await close_fleet(fleet)


async def test_second_failure_before_the_first_token_is_the_engines_own() -> None:
    """Retried once only: the second engine's refusal reaches the client as it came."""
    faults = GenerateFaults(["unavailable", "overloaded"])
    fleet, engines = await two_engine_fleet(faults)
    try:
        reply = [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3], 4))]
        assert [r.WhichOneof("event") for r in reply] == ["error"]
        assert reply[0].error.message == "scripted: overloaded" and reply[0].error.retryable
        assert calls(engines, "r") == 2
        assert fleet.app.controller.metrics.retries._value.get() == 1
    finally:
        await close_fleet(fleet)


async def test_a_request_is_retried_once_however_many_engines_remain() -> None:
    """Three engines, the first two failing before the first token: the second failure is
    the client's answer (naming its engine), the third engine is never asked."""
    faults = GenerateFaults(["unavailable", "unavailable"])
    engines = [await start_scripted_engine(f"e{i}", faults) for i in range(3)]
    fleet = await scripted_fleet(*engines)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3], 4))]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed the request: UNAVAILABLE: scripted: not now" in (err.value.details() or "")
        assert calls(engines, "r") == 2
        assert fleet.app.controller.metrics.retries._value.get() == 1
    finally:
        await close_fleet(fleet)


async def test_an_in_band_overload_the_client_gets_counts_as_overloaded() -> None:
    """Both engines accept the request and end it with a retryable EngineError OVERLOADED:
    the client gets the second one, and the gateway counts the request as one an engine
    refused for capacity (as the status RESOURCE_EXHAUSTED), not as an engine's failure."""
    fleet, engines = await two_engine_fleet(GenerateFaults(["overloaded", "overloaded"]))
    try:
        reply = [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3], 4))]
        assert [r.error.code for r in reply] == [pb.ERROR_CODE_OVERLOADED]
        assert calls(engines, "r") == 2
        outcomes = fleet.app.controller.metrics.requests
        assert outcomes.labels("overloaded")._value.get() == 1
        assert outcomes.labels("engine_error")._value.get() == 0
    finally:
        await close_fleet(fleet)


async def test_a_model_not_found_from_an_engine_holding_the_adapter_is_its_own(
    tmp_path: Path,
) -> None:
    """A guard on the LoRA re-route (Relay.adapter_left): x is on e0 and e1, and the engine a
    request naming x goes to ends it MODEL_NOT_FOUND while it still holds x (asked again, it
    lists x): the refusal is not about the adapter, so it reaches the client as the engine
    sent it, and no other engine is asked."""
    faults = GenerateFaults(["model_not_found"])
    engines = [
        await start_scripted_engine(f"e{i}", faults, advertise_lora=True, lora_enabled=True)
        for i in range(2)
    ]
    fleet = await scripted_fleet(*engines)
    try:
        x = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=str(tmp_path / "x"))
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        request = generate_request("r", [1, 2, 3], 4)
        request.lora_name = "x"
        reply = [r async for r in fleet.gateway.Generate(request)]
        assert [(r.error.code, r.error.message) for r in reply] == [
            (pb.ERROR_CODE_MODEL_NOT_FOUND, "scripted: model_not_found")
        ]
        assert calls(engines, "r") == 1
        registry = fleet.app.controller.fleet.registry
        assert all(r.holds_lora("x") for r in registry.records())
    finally:
        await close_fleet(fleet)


async def test_an_engine_refusing_the_controllers_token_is_not_the_clients_error() -> None:
    """With no other engine to retry on, the client gets the engine's refusal naming the
    engine and the controller's setting: the client's own token was never sent there (it
    was passed on bare, reading as a refusal of the client's token)."""
    engine = await start_scripted_engine("e0", GenerateFaults(["unauthenticated"]))
    fleet = await scripted_fleet(engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3], 4))]
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == (
            f"engine {address(engine)} failed the request: UNAUTHENTICATED: scripted: not the "
            "token (a server requiring a token? give engine_token_file)"
        )
        assert fleet.app.controller.metrics.requests.labels("engine_error")._value.get() == 1
    finally:
        await close_fleet(fleet)


async def test_retry_with_no_other_engine_returns_the_engines_failure() -> None:
    faults = GenerateFaults(["unavailable"])
    engine = await start_scripted_engine("e0", faults)
    fleet = await scripted_fleet(engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3], 4))]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The engine's failure, naming it: bare, it would read as the controller's own.
        assert err.value.details() == (
            f"engine {address(engine)} failed the request: UNAVAILABLE: scripted: not now"
        )
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("fault", ["token_then_error", "token_then_unavailable", "invalid"])
async def test_failure_after_acceptance_is_one_terminal_error_and_no_retry(fault: str) -> None:
    faults = GenerateFaults([fault])
    fleet, engines = await two_engine_fleet(faults)
    try:
        reply = [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3], 50))]
        kinds = [r.WhichOneof("event") for r in reply]
        expected = ["error"] if fault == "invalid" else ["token", "error"]
        assert kinds == expected
        error = reply[-1].error
        if fault == "token_then_unavailable":  # the gateway's own terminal error
            # Retryable: sent again, the request can succeed (another engine, or this one back).
            assert (error.code, error.retryable) == (pb.ERROR_CODE_INTERNAL, True)
            assert "UNAVAILABLE" in error.message
        else:  # the engine's, unchanged
            assert error.message == f"scripted: {fault}"
        assert calls(engines, "r") == 1
        metrics = fleet.app.controller.metrics
        assert metrics.retries._value.get() == 0
        # An in-band OVERLOADED counts as the status RESOURCE_EXHAUSTED does, output or not.
        outcome = "overloaded" if fault == "token_then_error" else "engine_error"
        assert metrics.requests.labels(outcome)._value.get() == 1
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("fault", ["finished_then_internal", "token_then_error_then_internal"])
async def test_an_engine_failing_after_its_terminal_event_adds_nothing_after_it(
    fault: str,
) -> None:
    """Seed: nothing follows a stream's terminal event (the last GenerationFinished, or an
    EngineError). An engine call that fails after it was relayed ends the client's stream
    as the engine ended it, with OK: no second terminal EngineError of the gateway's."""
    fleet, engines = await two_engine_fleet(GenerateFaults([fault]))
    try:
        reply = [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3], 4))]
        kinds = [r.WhichOneof("event") for r in reply]
        finished = fault == "finished_then_internal"
        assert kinds == (["token"] * 4 + ["finished"] if finished else ["token", "error"])
        assert calls(engines, "r") == 1
        outcome = "ok" if finished else "overloaded"  # the engine's EngineError OVERLOADED
        assert fleet.app.controller.metrics.requests.labels(outcome)._value.get() == 1
        assert fleet.app.gateway.relay.holding == {}
    finally:
        await close_fleet(fleet)


async def test_an_engine_failing_after_one_of_two_sequences_finished_ends_with_an_error() -> None:
    """A request for two sequences is not over when the first one finishes: an engine call
    that fails then (the second still running) ends the client's stream with one terminal
    EngineError of the gateway's, not silently as if both had finished."""
    fleet, engines = await two_engine_fleet(GenerateFaults(["finished_then_unavailable"]))
    try:
        request = generate_request("r", [1, 2, 3], 4)
        request.sampling.num_sequences = 2
        reply = [r async for r in fleet.gateway.Generate(request)]
        finished = [r.finished.output_index for r in reply if r.WhichOneof("event") == "finished"]
        assert len(finished) == 1
        assert reply[-1].WhichOneof("event") == "error"
        assert (reply[-1].error.code, reply[-1].error.retryable) == (pb.ERROR_CODE_INTERNAL, True)
        assert "UNAVAILABLE" in reply[-1].error.message
        assert calls(engines, "r") == 1
        metrics = fleet.app.controller.metrics
        assert metrics.requests.labels("engine_error")._value.get() == 1
    finally:
        await close_fleet(fleet)


# ---- GetLoad ----


async def test_get_load_sums_the_engines_and_details_each() -> None:
    """The fleet's figures are the sums of what each engine reported (a field an engine
    leaves out counts as nothing); every engine has a line of detail, '?' for what it did not
    report."""
    engines = [await start_fronted_engine(f"l{i}", ReportsLoad) for i in range(2)]
    engines[0].servicer.load = {
        "running_requests": 2, "queued_requests": 3, "used_kv_blocks": 10,
        "total_kv_blocks": 100, "waiting_tokens": 70,
    }  # fmt: skip
    engines[1].servicer.load = {
        "running_requests": 5, "queued_requests": None, "used_kv_blocks": 1,
        "total_kv_blocks": 50, "waiting_tokens": 8,
    }  # fmt: skip
    fleet = await make_fleet(engines=engines)
    registry = fleet.app.controller.fleet.registry
    try:
        await fleet.app.controller.fleet.wait_for(
            lambda: (
                [r.load.total_kv_blocks for r in registry.records()]
                == [e.servicer.load["total_kv_blocks"] for e in sorted(engines, key=address)]
            ),
            15,
        )
        await fleet.admin.Cordon(apb.EngineRef(engine="l1"))
        load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        assert (
            load.running_requests, load.queued_requests, load.used_kv_blocks,
            load.total_kv_blocks, load.waiting_tokens,
        ) == (7, 3, 11, 150, 78)  # fmt: skip
        # The KV in tokens too (blocks of 16), summed as the blocks are.
        assert (load.attributes["used_kv_tokens"], load.attributes["total_kv_tokens"]) == (
            str(11 * 16),
            str(150 * 16),
        )
        assert (
            load.instance_id
            == (await fleet.gateway.GetEngineInfo(pb.GetEngineInfoRequest())).instance_id
        )
        assert (load.attributes["engines"], load.attributes["routable_engines"]) == ("2", "1")
        assert load.attributes[f"engine.{address(engines[0])}"] == (
            "instance=l0 role=aggregated state=ready cordoned=False running=2 queued=3 kv=10/100 "
            "block_size=16 inflight=0"
        )
        assert load.attributes[f"engine.{address(engines[1])}"] == (
            "instance=l1 role=aggregated state=ready cordoned=True running=5 queued=? kv=1/50 "
            "block_size=16 inflight=0"
        )
    finally:
        await close_fleet(fleet)


# The LoadInfo figures the fleet's GetLoad sums over its engines.
SummedLoad = Literal[
    "running_requests", "queued_requests", "used_kv_blocks", "total_kv_blocks", "waiting_tokens"
]


async def test_get_load_leaves_out_what_no_engine_reports() -> None:
    """Seed: an absent load figure is unavailable, a present zero a measured zero. A figure
    no engine reports (here queued requests and waiting tokens), or every figure while no
    engine answers, is absent from the fleet's LoadInfo, not 0; a reported 0 is present."""
    engines = [await start_fronted_engine(f"l{i}", ReportsLoad) for i in range(2)]
    for engine in engines:
        engine.servicer.load = {"running_requests": 0, "queued_requests": None,
                                "waiting_tokens": None}  # fmt: skip
    fleet = await make_fleet(engines=engines)
    registry = fleet.app.controller.fleet.registry
    summed: tuple[SummedLoad, ...] = ("running_requests", "queued_requests", "used_kv_blocks",
                                      "total_kv_blocks", "waiting_tokens")  # fmt: skip
    try:
        await fleet.app.controller.fleet.wait_for(
            lambda: all(r.load.queued_requests is None for r in registry.records()), 15
        )
        load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        assert [load.HasField(name) for name in summed] == [True, False, True, True, False]
        assert load.running_requests == 0
        for engine in engines:
            await engine.close()
        await fleet.app.controller.fleet.wait_for(
            lambda: all(r.load.total_kv_blocks is None for r in registry.records()), 15
        )
        load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        assert [name for name in summed if load.HasField(name)] == []
    finally:
        await close_fleet(fleet)


# ---- Health ----


class FailsProbe(Forwarding):
    """The sim engine, whose inference probe fails (a broken device: it answers polls)."""

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        reply = await self.inner.Health(request)
        if request.include_inference_probe:
            reply.state = pb.HEALTH_STATE_NOT_READY
            for check in reply.checks:
                if check.name == "inference_probe":
                    check.state = pb.HEALTH_STATE_NOT_READY
                    check.message = "probe failed: scripted"
        return reply


async def test_an_inference_probe_failing_on_some_engines_degrades_the_fleet() -> None:
    """Health(include_inference_probe): DEGRADED while some engines pass their probe (the
    fleet still serves), NOT_READY once none does; the check names each engine's result."""
    broken = await start_fronted_engine("broken", FailsProbe)
    fine = await start_scripted_engine("fine")
    fleet = await make_fleet(engines=engines_of_kinds(broken, fine))
    probe = pb.HealthRequest(include_inference_probe=True)
    try:
        assert (await fleet.gateway.Health(pb.HealthRequest())).state == pb.HEALTH_STATE_READY
        reply = await fleet.gateway.Health(probe)
        assert reply.state == pb.HEALTH_STATE_DEGRADED
        (check,) = [c for c in reply.checks if c.name == "inference_probe"]
        assert check.state == pb.HEALTH_STATE_DEGRADED
        assert f"127.0.0.1:{broken.port}: probe failed: scripted" in check.message
        assert f"{address(fine)}: generated 1 token" in check.message
        await fleet.admin.Cordon(apb.EngineRef(engine="fine"))
        reply = await fleet.gateway.Health(probe)
        (check,) = [c for c in reply.checks if c.name == "inference_probe"]
        assert (reply.state, check.state) == (pb.HEALTH_STATE_NOT_READY,) * 2
    finally:
        await close_fleet(fleet)


# ---- GetModelInfo ----


class RefusesModelInfo(Forwarding):
    """GetModelInfo refused with `refusal` once set (the controller reads the model's info
    when it first reaches the engine, before the test sets it)."""

    refusal: grpc.StatusCode | None = None

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        if self.refusal is not None:
            await context.abort(self.refusal, f"scripted: {self.refusal.name}")
        return await self.inner.GetModelInfo(request)


async def test_model_info_passes_an_engines_refusal_and_skips_one_that_cannot_answer() -> None:
    """An engine that cannot answer now (UNAVAILABLE) leaves the question to the next; any
    other refusal is the answer; UNAVAILABLE when no engine could answer."""
    engines = [await start_fronted_engine(f"m{i}", RefusesModelInfo) for i in range(2)]
    fleet = await make_fleet(engines=engines)
    request = pb.GetModelInfoRequest(model="sim")
    try:
        engines[0].servicer.refusal = grpc.StatusCode.UNAVAILABLE
        assert (await fleet.gateway.GetModelInfo(request)).HasField("kv_block_size")
        engines[1].servicer.refusal = grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.GetModelInfo(request)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details() == "scripted: FAILED_PRECONDITION"
        engines[1].servicer.refusal = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.GetModelInfo(request)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Each engine's refusal, so that the client sees why.
        reason, _, refusals = (err.value.details() or "").partition(": ")
        assert reason == "no engine serving 'sim' can answer now"
        assert sorted(refusals.split("; ")) == [
            f"m{i} UNAVAILABLE: scripted: UNAVAILABLE" for i in range(2)
        ]
    finally:
        await close_fleet(fleet)


# ---- Abort ----


class AcceptsLate(Forwarding):
    """Holds each Generate before the sim engine sees it (as a call still on its way, or an
    engine still validating it) until `gate` opens; records the calls cancelled meanwhile."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.arrived: list[str] = []
        self.cancelled: list[str] = []

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.arrived.append(request.request_id)
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        async for response in self.inner.Generate(request):
            yield response

    async def Abort(self, request: pb.AbortRequest, context: Context) -> Any:
        try:
            return await self.inner.Abort(request)
        except grpc.aio.AioRpcError as exc:  # the sim engine's status, as it answered
            await context.abort(exc.code(), exc.details() or "")


async def test_abort_of_a_request_its_engine_has_not_accepted_yet_ends_it() -> None:
    """An Abort between routing and the engine's acceptance: the engine answers NOT_FOUND
    (it has no such request yet), so the gateway ends the request itself: ABORTED, the
    stream ends as an engine ends a request aborted before its prefill (status OK, each
    output finished CANCELLED; it ended with the status CANCELLED), and its engine call is
    cancelled (it was NOT_FOUND, and the request ran to its end once the engine took it)."""
    request = generate_request("r", [1, 2, 3], max_tokens=4)
    request.sampling.num_sequences = 2
    expected = await ended_while_queued(request)
    engine = await start_fronted_engine("late", AcceptsLate)
    fleet = await make_fleet(engines=[engine])
    try:
        running = asyncio.ensure_future(
            asyncio.wait_for(collect(fleet.gateway.Generate(request)), 30)
        )

        async def arrived() -> bool:
            return engine.servicer.arrived == ["r"]

        await eventually(arrived)
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="r"))
        assert reply.status == pb.ABORT_STATUS_ABORTED
        assert await running == expected

        async def cancelled() -> bool:
            return engine.servicer.cancelled == ["r"]

        await eventually(cancelled)
        assert fleet.app.controller.metrics.requests.labels("aborted")._value.get() == 1

        # The gateway frees the request id as its handler unwinds, which may be just after
        # the client has its status.
        await eventually(lambda: fleet.app.gateway.relay.running == set())
    finally:
        engine.servicer.gate.set()
        await close_fleet(fleet)


async def collect(
    call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
) -> list[pb.GenerateResponse]:
    return [r async for r in call]


@dataclass
class FirstCallFails:
    """Shared by the engines of a fleet: the first Generate any of them receives waits for
    `fail`, then fails UNAVAILABLE before any output (the gateway retries it elsewhere);
    that engine's Abort waits for `answer` (it answers as its sim engine does, which never
    saw the request: NOT_FOUND)."""

    fail: asyncio.Event = field(default_factory=asyncio.Event)
    answer: asyncio.Event = field(default_factory=asyncio.Event)
    first: Forwarding | None = None
    aborts_held: int = 0


class FailsFirstCall(Forwarding):
    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub, script: FirstCallFails) -> None:
        super().__init__(inner)
        self.script = script

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.script.first is None:
            self.script.first = self
            await self.script.fail.wait()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: going away")
        async for response in self.inner.Generate(request):
            yield response

    async def Abort(self, request: pb.AbortRequest, context: Context) -> Any:
        if self.script.first is self:
            self.script.aborts_held += 1
            await self.script.answer.wait()
        try:
            return await self.inner.Abort(request)
        except grpc.aio.AioRpcError as exc:  # the sim engine's status, as it answered
            await context.abort(exc.code(), exc.details() or "")


async def test_an_abort_follows_a_request_that_moved_to_another_engine_meanwhile() -> None:
    """An Abort by id goes to the engine holding the request; if that engine fails the
    request meanwhile (before any output: retried on another engine) and answers the Abort
    only then (NOT_FOUND: it has no such request), the Abort goes to the engine running it
    now: ABORTED, the stream ends as an aborted request's. (It answered the first engine's
    NOT_FOUND, and the request ran on to its end.)"""
    script = FirstCallFails()
    engines = [
        await start_fronted_engine(
            name, lambda inner: FailsFirstCall(inner, script), time_scale=0.5
        )
        for name in ("e0", "e1")
    ]
    fleet = await make_fleet(engines=engines)
    try:
        call = fleet.gateway.Generate(generate_request("r", [1, 2, 3], max_tokens=2000))
        await eventually(lambda: script.first is not None)
        abort = asyncio.ensure_future(fleet.gateway.Abort(pb.AbortRequest(request_id="r")))
        await eventually(lambda: script.aborts_held == 1)
        script.fail.set()
        first = await call.read()  # from the other engine: the request runs there
        assert isinstance(first, pb.GenerateResponse) and first.WhichOneof("event") == "token"
        script.answer.set()
        reply = await asyncio.wait_for(abort, 30)
        assert reply.status == pb.ABORT_STATUS_ABORTED
        last = first
        while (response := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
            assert isinstance(response, pb.GenerateResponse)
            last = response
        assert last.finished.reason == pb.FINISH_REASON_CANCELLED
    finally:
        script.fail.set()
        script.answer.set()
        await close_fleet(fleet)


@dataclass
class FirstEngineEnds(FirstCallFails):
    """As `FirstCallFails`, except that the first Generate runs: its first response is
    relayed, then the rest once `finish` is set. The engine that took it fails every later
    Generate UNAVAILABLE before any output (`fail` is unused), or with `later_calls_wait`
    passes them on once it has answered an Abort (`answered`)."""

    finish: asyncio.Event = field(default_factory=asyncio.Event)
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    later_calls_wait: bool = False


class EndsFirstCall(FailsFirstCall):
    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub, script: FirstEngineEnds) -> None:
        super().__init__(inner, script)
        self.ends = script

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.script.first is None:
            self.script.first = self
            relayed = 0
            async for response in self.inner.Generate(request):
                if relayed == 1:
                    await self.ends.finish.wait()
                relayed += 1
                yield response
            return
        if self.script.first is self and self.ends.later_calls_wait:
            await self.ends.answered.wait()
        elif self.script.first is self:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: going away")
        async for response in self.inner.Generate(request):
            yield response

    async def Abort(self, request: pb.AbortRequest, context: Context) -> Any:
        try:
            return await super().Abort(request, context)
        finally:
            self.ends.answered.set()


async def abort_held_as_its_request_ends(
    fleet: EngineFleet[Any], script: FirstEngineEnds
) -> asyncio.Future[pb.AbortResponse]:
    """A request "r" runs on the engine taking it, an Abort of it is sent and held there
    (`script`), and the request ends (LENGTH) meanwhile: the Abort, unanswered."""
    ended = fleet.gateway.Generate(generate_request("r", [1, 2, 3], max_tokens=4))
    assert isinstance(await ended.read(), pb.GenerateResponse)
    abort = asyncio.ensure_future(fleet.gateway.Abort(pb.AbortRequest(request_id="r")))
    await eventually(lambda: script.aborts_held == 1)
    script.finish.set()
    responses = []
    while (response := await asyncio.wait_for(ended.read(), 30)) is not grpc.aio.EOF:
        assert isinstance(response, pb.GenerateResponse)
        responses.append(response)
    assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
    await eventually(lambda: "r" not in fleet.app.gateway.relay.running)
    return abort


async def test_an_abort_never_follows_its_id_to_a_later_request() -> None:
    """An Abort by id whose engine answers ALREADY_FINISHED only after the request ended
    there, and a new request reused the id on another engine meanwhile, answers
    ALREADY_FINISHED: the request it was sent for ended; the new request runs on."""
    script = FirstEngineEnds()
    engines = [
        await start_fronted_engine(name, lambda inner: EndsFirstCall(inner, script), time_scale=0.5)
        for name in ("e0", "e1")
    ]
    fleet = await make_fleet(engines=engines)
    relay = fleet.app.gateway.relay
    try:
        abort = await abort_held_as_its_request_ends(fleet, script)
        later = fleet.gateway.Generate(generate_request("r", [1, 2, 3], max_tokens=2000))
        first = await later.read()  # from the other engine: the later request runs there
        assert isinstance(first, pb.GenerateResponse) and first.WhichOneof("event") == "token"
        script.answer.set()
        reply = await asyncio.wait_for(abort, 30)
        assert reply.status == pb.ABORT_STATUS_ALREADY_FINISHED
        assert "r" in relay.running  # the later request was not aborted
        later.cancel()
    finally:
        script.finish.set()
        script.answer.set()
        await close_fleet(fleet)


async def test_an_abort_finding_its_request_ended_leaves_a_later_one_there_charged() -> None:
    """As above, the later request routed to the same engine, reaching it only after the
    Abort's answer (ALREADY_FINISHED): the gateway, told that the request asked about ended
    there, does not end the later one's charge on the engine (the router counts it on)."""
    script = FirstEngineEnds(later_calls_wait=True)
    engine = await start_fronted_engine("e0", lambda inner: EndsFirstCall(inner, script))
    fleet = await make_fleet(engines=[engine])
    inflight = fleet.app.controller.router.inflight
    try:
        abort = await abort_held_as_its_request_ends(fleet, script)
        later = fleet.gateway.Generate(generate_request("r", [1, 2, 3], max_tokens=4))
        await eventually(lambda: len(inflight) == 1)  # routed, held before the engine
        script.answer.set()
        reply = await asyncio.wait_for(abort, 30)
        assert reply.status == pb.ABORT_STATUS_ALREADY_FINISHED
        assert len(inflight) == 1  # the later request is still charged to its engine
        responses = [r async for r in later]
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert len(inflight) == 0
    finally:
        script.finish.set()
        script.answer.set()
        await close_fleet(fleet)


async def test_abort_everything_with_no_engine_reachable_is_unavailable() -> None:
    engines = [await start_scripted_engine("e0"), await start_scripted_engine("e1")]
    # Slow polls: the controller still believes both engines are up when they are gone.
    fleet = await scripted_fleet(
        *engines, health={"poll_interval_s": 60, "load_poll_interval_s": 60}
    )
    try:
        everything = pb.AbortRequest(all_requests=pb.AllRequests())
        reply = await fleet.gateway.Abort(everything)
        assert reply.status == pb.ABORT_STATUS_ABORTED
        for engine in engines:
            await engine.server.stop(None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(everything)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Engines the poller already found gone are not asked; the others answer UNAVAILABLE.
        reported = {v["outcome"] for v in outcomes(err.value.trailing_metadata()).values()}
        assert reported <= {"UNAVAILABLE"}
    finally:
        await close_fleet(fleet)


class RemovesTheOthers(Forwarding):
    """Refuses Generate with UNAVAILABLE after removing every other engine from the fleet:
    the retry finds no engine the request was planned with still there."""

    fleet: EngineFleet[Any] | None = None
    address = ""  # its own, as the controller dials it

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        assert self.fleet is not None
        controller = self.fleet.app.controller
        for record in controller.fleet.registry.records():
            if record.address != self.address:
                await controller.fleet.remove_engine(record.address)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: not now")
        yield pb.GenerateResponse()  # unreachable: makes this a stream handler


async def test_a_retry_never_goes_to_an_engine_that_left_the_fleet() -> None:
    engines = [await start_fronted_engine(f"f{i}", RemovesTheOthers) for i in range(2)]
    fleet = await make_fleet(engines=engines)
    for engine in engines:
        engine.servicer.fleet, engine.servicer.address = fleet, f"127.0.0.1:{engine.port}"
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in fleet.gateway.Generate(generate_request("r", list(range(40))))]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the engine's own refusal
        assert "scripted" in (info.value.details() or "")
        assert not fleet.app.gateway.relay.holding
        assert len(fleet.app.controller.router.inflight) == 0
        drain = [r async for r in fleet.gateway.Drain(pb.DrainRequest())]
        assert drain[-1].state == pb.DRAIN_STATE_COMPLETE
    finally:
        await close_fleet(fleet)
