"""`kvplane admin ...`: operate a controller (or a single engine) over gRPC.

`--target HOST:PORT` names the server (on the group or on each command). Commands that only
need OpenEngine RPCs (health, load, info, abort, lora, drain --self) work against a
controller and against any engine; the fleet commands (workers, match, route, register,
remove, cordon, uncordon, drain ENGINE, lora load/unload --engine) use the controller's admin
API: against a bare engine they fail with one line saying they need a controller (exit 1),
except `workers`, which shows that engine. Tables by default, `--output json` for scripts. The
bearer token for mutating RPCs comes from `--token-file` or the KVPLANE_TOKEN environment
variable. A TLS server is dialled with the admin group's `--tls-ca` (and
`--tls-cert`/`--tls-key` for mutual TLS).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import grpc
import typer
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from controller.config import KvEventsMode
from controller.fleet import SERVING_STATES
from controller.model_info import generates
from controller.outcomes import ENGINE_METADATA_KEY, lora_model_metadata, read_outcomes
from indexer.admin_cli import TOKENS_FILE_FORMATS, read_token_ids
from indexer.validation import MAX_UINT32
from kvplane.channels import METHOD_NOT_FOUND
from kvplane.cli_common import (
    OLDER_RELEASE,
    RPC_TIMEOUT_S,
    ClientTarget,
    OutputFormat,
    OutputOption,
    RpcCallError,
    TokenFileOption,
    a_name,
    emit,
    finite_number,
    is_kind,
    models_cell,
    not_blank,
    server_kind,
    target_option,
    usage_error_for,
)
from kvplane.config import parse_dial_target
from kvplane.enum_names import enum_name
from kvplane.errors import KvplaneError
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:8100"
# What --target must be for the commands of openengine.v1.OpenEngine (rpc_channel).
TARGET_KIND = "a controller or an engine"
# The proto fields' ranges: deadlines are uint32 (MAX_UINT32; a larger value makes protobuf
# raise ValueError), LoRA ids int64.
INT64_MAX = 2**63 - 1
T = TypeVar("T")

TargetOpt = Annotated[
    str | None, target_option("HOST:PORT of the controller or engine.", DEFAULT_TARGET)
]
# The fleet commands' (match, route, register, remove, cordon, uncordon): an engine has no
# admin API, so they need a controller.
ControllerTargetOpt = Annotated[
    str | None, target_option("HOST:PORT of the controller.", DEFAULT_TARGET)
]
PromptOpt = Annotated[
    str | None,
    typer.Option("--prompt", help="Prompt text.", callback=not_blank("the prompt's text")),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Model the request names (default: the fleet's default model).",
        callback=not_blank("a model name, or leave it out for the default model"),
    ),
]
# An empty --lora or --cache-salt is what leaving it out means: a request without one.
LoraOpt = Annotated[
    str,
    typer.Option(
        "--lora", help="LoRA adapter the request names (its engines, its cache; default: none)."
    ),
]
CacheSaltOpt = Annotated[
    str,
    typer.Option(
        "--cache-salt", help="The request's cache salt (its own cached prefixes; default: none)."
    ),
]
EngineOpt = Annotated[
    str | None, typer.Option("--engine", help="Only this fleet engine.", callback=a_name)
]
LoraModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Only the fleet engines serving this base model, and those that join later "
        "(needed when the fleet's LoRA-capable engines serve several); with --engine, that "
        "engine's (a controller fronted as an engine serving several).",
        callback=not_blank("the base model the adapter was trained for"),
    ),
]
TokensFileOpt = Annotated[
    Path | None,
    typer.Option("--tokens-file", help=f"Prompt token ids: {TOKENS_FILE_FORMATS}."),
]


def _server(ctx: typer.Context, target: str | None, token_file: Path | None = None) -> ClientTarget:
    return ClientTarget.of(ctx, target, DEFAULT_TARGET, token_file)


def _dict(message: Message) -> dict[str, Any]:
    data = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _unquote_int64(message.DESCRIPTOR, data)
    return data


_INT64 = frozenset({FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64})


def _unquote_int64(descriptor: Any, data: dict[str, Any]) -> None:
    """64-bit integers as JSON numbers, as every other integer (protobuf's JSON mapping
    quotes them): `total_kv_blocks` is the same type whether a controller or an engine
    answered, and `kvplane admin index` prints them the same way. `descriptor`: the
    message's (protobuf types it as its Python or its upb Descriptor)."""
    for field in descriptor.fields:
        value = data.get(field.name)
        kind = field.message_type
        if value is None or (kind is not None and kind.full_name.startswith("google.")):
            continue  # absent, or a well-known type with a JSON form of its own
        if kind is not None and kind.GetOptions().map_entry:
            entry = kind.fields_by_name["value"]
            for key, item in value.items():
                if entry.cpp_type in _INT64:
                    value[key] = int(item)
                elif entry.message_type is not None:
                    _unquote_int64(entry.message_type, item)
        elif kind is not None:
            for item in value if field.is_repeated else [value]:
                _unquote_int64(kind, item)
        elif field.cpp_type in _INT64:
            data[field.name] = [int(v) for v in value] if field.is_repeated else int(value)


def _call(server: ClientTarget, rpc: Callable[[grpc.Channel], T]) -> T:
    with server.channel(TARGET_KIND) as channel:
        return rpc(channel)


def _is_unimplemented(exc: grpc.RpcError) -> bool:
    return isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNIMPLEMENTED


class ControllerRequiredError(KvplaneError):
    """A fleet command was sent to a target without the controller's admin API (an engine, an
    indexer: named by `server_kind`)."""


def _admin_call(command: str, server: ClientTarget, rpc: Callable[[apb_grpc.AdminStub], T]) -> T:
    """Call the controller's admin API; a target that lacks it (a bare engine answers
    UNIMPLEMENTED) fails with one line saying so rather than gRPC's "Method not found!"."""
    with server.channel() as channel:
        try:
            return rpc(apb_grpc.AdminStub(channel))
        except grpc.RpcError as exc:
            if not _is_unimplemented(exc):
                raise
            kind = server_kind(channel)
            if is_kind(kind, "a controller"):
                if isinstance(exc, grpc.Call) and exc.details() != METHOD_NOT_FOUND:
                    raise  # the controller's own refusal, said as it is
                raise RpcCallError(f"{server.address} is {kind} {OLDER_RELEASE}") from None
            what = f"is {kind}, which serves" if kind else "serves"
            raise ControllerRequiredError(
                f"`{command}` needs a controller: {server.address} {what} no kvplane admin "
                "API; give the controller's --target"
            ) from None


class NotServingError(KvplaneError):
    """`health` answered, with a state in which the target serves no request."""


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers, *[["-" if v is None or v == "" else str(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _prompt_query(
    prompt: str | None, tokens_file: Path | None, model: str | None, lora: str, cache_salt: str
) -> apb.PromptQuery:
    if (prompt is None) == (tokens_file is None):
        raise typer.BadParameter("give exactly one of --prompt and --tokens-file")
    query = apb.PromptQuery(model=model or "", lora_name=lora, cache_salt=cache_salt)
    if prompt is not None:
        query.prompt = prompt
    else:
        assert tokens_file is not None
        query.token_ids.ids.extend(read_token_ids(tokens_file))
    return query


# ---- fleet view ----


def workers(
    ctx: typer.Context, target: TargetOpt = None, output: OutputOption = OutputFormat.table
) -> None:
    """The fleet's engines (or, against an engine, that engine)."""
    server = _server(ctx, target)
    with server.channel(TARGET_KIND) as channel:
        try:
            reply = apb_grpc.AdminStub(channel).ListWorkers(
                apb.ListWorkersRequest(), timeout=RPC_TIMEOUT_S
            )
            data = _dict(reply)
            data.setdefault("workers", [])
        except grpc.RpcError as exc:
            if not _is_unimplemented(exc):
                raise
            data = {"workers": [_engine_as_worker(channel, server.address)]}
    emit(data, output, _render_workers)


def _engine_as_worker(channel: grpc.Channel, address: str) -> dict[str, Any]:
    stub = pb_grpc.OpenEngineStub(channel)
    info = stub.GetEngineInfo(pb.GetEngineInfoRequest(), timeout=RPC_TIMEOUT_S)
    health = stub.Health(pb.HealthRequest(), timeout=RPC_TIMEOUT_S)
    load = stub.GetLoad(pb.GetLoadRequest(), timeout=RPC_TIMEOUT_S)
    role = enum_name(pb.EngineRole.DESCRIPTOR, info.role)
    state = enum_name(pb.HealthState.DESCRIPTOR, health.state)
    row: dict[str, Any] = {
        "address": address,
        "instance_id": info.instance_id,
        "engine_name": info.engine_name,
        "role": role.removeprefix("ENGINE_ROLE_").lower(),
        "models": list(info.supported_models),
        "state": state.removeprefix("HEALTH_STATE_").lower(),
    }
    for name in ("running_requests", "queued_requests", "used_kv_blocks", "total_kv_blocks"):
        if load.HasField(name):
            row[name] = getattr(load, name)
    # Each model's ModelInfo says whether it generates (as the controller asks): an engine is
    # pooling-only when none of its models does.
    try:
        models = [
            stub.GetModelInfo(pb.GetModelInfoRequest(model=m), timeout=RPC_TIMEOUT_S)
            for m in info.supported_models
        ]
    except grpc.RpcError as exc:
        if not _is_unimplemented(exc):
            raise
    else:
        if models:
            row["pooling_only"] = not any(generates(m) for m in models)
    return row


def _kv_events(worker: dict[str, Any]) -> str | None:
    """How the controller follows the engine's KV events: `following since 10:02:13Z (last
    10:04:40Z)`, `down since 10:03:58Z: publisher tcp://... disconnected`, `other_replica: ...`
    (None against a bare engine, which has no such state). Times of day (UTC) as the
    controller's clock tells them: an age computed here would add the two clocks' skew."""
    state = worker.get("kv_events_state")
    if not state:
        return None
    since = worker.get("kv_events_since_unix_s")
    text = state if since is None else f"{state} since {_utc_time(since)}"
    if state == "following":
        last = worker.get("last_kv_event_unix_s")
        return text if last is None else f"{text} (last {_utc_time(last)})"
    reason = worker.get("kv_events_reason")
    return f"{text}: {reason}" if reason else text


def _utc_time(unix_s: float) -> str:
    """A time of day in UTC, as `10:02:13Z`."""
    return time.strftime("%H:%M:%SZ", time.gmtime(unix_s))


def _render_workers(data: dict[str, Any]) -> str:
    # A pooling-only engine (`runner: pooling`) gets no Generate and caches no prompt: its
    # role says so, and it has no KV figure (its one-block cache is a placeholder). SOURCE:
    # where the engine came from, `config` (the controller's engines: list) or `admin`
    # (registered at run time, by an operator or the planner; gone at a controller restart).
    rows = [
        [
            w.get("instance_id"),
            w.get("address"),
            w.get("source"),
            models_cell(w.get("models", ())),
            f"{w.get('role')} (pooling only)" if w.get("pooling_only") else w.get("role"),
            w.get("state"),
            "yes" if w.get("cordoned") else "",
            w.get("running_requests", 0),
            w.get("queued_requests", 0),
            "-"
            if w.get("pooling_only")
            else f"{w.get('used_kv_blocks', '?')}/{w.get('total_kv_blocks', '?')}",
            w.get("indexed_blocks"),
            _kv_events(w),
            w.get("inflight_requests"),
            w.get("last_error"),
        ]
        for w in data["workers"]
    ]
    headers = [
        "ENGINE",
        "ADDRESS",
        "SOURCE",
        "MODELS",
        "ROLE",
        "STATE",
        "CORDONED",
        "RUNNING",
        "QUEUED",
        "KV",
        "INDEXED",
        "KV EVENTS",
        "INFLIGHT",
        "ERROR",
    ]
    head = f"policy {data['policy']}\n" if data.get("policy") else ""
    return head + _table(headers, rows)


def health(
    ctx: typer.Context, target: TargetOpt = None, output: OutputOption = OutputFormat.table
) -> None:
    """Health of the target (a controller lists every engine as a check).

    Exits 1, after showing it, when the target is not serving (a state other than READY or
    DEGRADED), as a readiness probe reads it."""
    server = _server(ctx, target)
    reply = _call(
        server,
        lambda ch: pb_grpc.OpenEngineStub(ch).Health(pb.HealthRequest(), timeout=RPC_TIMEOUT_S),
    )
    data = _dict(reply)

    def render(d: dict[str, Any]) -> str:
        lines = [f"state {d.get('state', 'HEALTH_STATE_UNSPECIFIED')}"]
        rows = [[c.get("name"), c.get("state"), c.get("message")] for c in d.get("checks", [])]
        if rows:
            lines.append(_table(["CHECK", "STATE", "MESSAGE"], rows))
        return "\n".join(lines)

    emit(data, output, render)
    if reply.state not in SERVING_STATES:
        state = enum_name(pb.HealthState.DESCRIPTOR, reply.state)
        raise NotServingError(f"{server.address} is not serving: its health is {state}")


# LoadInfo's fields that are no single figure: shown as tables of their own.
_LOAD_LISTS = frozenset({"ranks", "attributes"})
# The RankLoadInfo field saying which rank its other figures are of.
_RANK = "data_parallel_rank"


def load(
    ctx: typer.Context, target: TargetOpt = None, output: OutputOption = OutputFormat.table
) -> None:
    """GetLoad of the target (a controller sums its fleet, with per-engine detail).

    An engine's per-rank figures (data-parallel ranks) show in a table of their own."""
    # An engine reports its ranks only when asked; a controller has none (they are per engine).
    req = pb.GetLoadRequest(include_per_rank=True)
    reply = _call(
        _server(ctx, target),
        lambda ch: pb_grpc.OpenEngineStub(ch).GetLoad(req, timeout=RPC_TIMEOUT_S),
    )
    data = _dict(reply)

    def render(d: dict[str, Any]) -> str:
        # Every figure of LoadInfo in its order ("-": absent, unavailable); the per-rank
        # figures and the attributes below.
        keys = [f.name for f in pb.LoadInfo.DESCRIPTOR.fields if f.name not in _LOAD_LISTS]
        lines = [_table(["FIELD", "VALUE"], [[k, d.get(k)] for k in keys])]
        ranks = d.get("ranks", [])
        if ranks:
            # A column per rank, a row per figure (a row per rank would be wider than a
            # terminal): RANK 0 1 ..., then running_requests ...
            names = [f.name for f in pb.RankLoadInfo.DESCRIPTOR.fields if f.name != _RANK]
            headers = ["RANK", *(str(r.get(_RANK, "-")) for r in ranks)]
            lines.append(_table(headers, [[n, *(r.get(n) for r in ranks)] for n in names]))
        attributes = d.get("attributes", {})
        if attributes:
            lines.append(
                _table(["ATTRIBUTE", "VALUE"], sorted([k, v] for k, v in attributes.items()))
            )
        return "\n".join(lines)

    emit(data, output, render)


def info(
    ctx: typer.Context, target: TargetOpt = None, output: OutputOption = OutputFormat.table
) -> None:
    """GetEngineInfo and GetModelInfo of every served model."""

    def rpc(ch: grpc.Channel) -> dict[str, Any]:
        stub = pb_grpc.OpenEngineStub(ch)
        engine = stub.GetEngineInfo(pb.GetEngineInfoRequest(), timeout=RPC_TIMEOUT_S)
        models = [
            _dict(stub.GetModelInfo(pb.GetModelInfoRequest(model=m), timeout=RPC_TIMEOUT_S))
            for m in engine.supported_models
        ]
        return {"engine": _dict(engine), "models": models}

    data = _call(_server(ctx, target), rpc)

    def render(d: dict[str, Any]) -> str:
        e = d["engine"]
        rows = [
            [k, e.get(k)]
            for k in (
                "engine_name",
                "engine_version",
                "instance_id",
                "role",
                "schema_revision",
                "minimum_client_revision",
                "schema_release",
            )
        ]
        lines = [_table(["FIELD", "VALUE"], rows)]
        for m in d["models"]:
            lines.append(
                _table(
                    ["MODEL", "SOURCE", "BLOCK SIZE", "KV BLOCKS", "MAX CONTEXT"],
                    [
                        [
                            # The name requests must carry, then where the weights come from.
                            m.get("served_model_name") or m.get("model_id"),
                            m.get("model_id"),
                            m.get("kv_block_size"),
                            m.get("total_kv_blocks"),
                            m.get("max_context_length"),
                        ]
                    ],
                )
            )
        return "\n\n".join(lines)

    emit(data, output, render)


def match(
    ctx: typer.Context,
    *,
    prompt: PromptOpt = None,
    tokens_file: TokensFileOpt = None,
    model: ModelOpt = None,
    lora: LoraOpt = "",
    cache_salt: CacheSaltOpt = "",
    target: ControllerTargetOpt = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """How much of a prompt each engine holds (controller).

    Engines the router would not choose now (cordoned, draining, unreachable, ..., or short of
    a limit this prompt needs) are listed too, with why in OUT OF ROUTING."""
    query = _prompt_query(prompt, tokens_file, model, lora, cache_salt)
    reply = _admin_call(
        "match", _server(ctx, target), lambda stub: stub.Match(query, timeout=RPC_TIMEOUT_S)
    )
    data = _dict(reply)
    data.setdefault("matches", [])

    def render(d: dict[str, Any]) -> str:
        head = (
            (
                f"{d.get('num_prompt_tokens', 0)} prompt tokens, {d.get('num_blocks', 0)} full "
                f"blocks of {d.get('block_size', 0)}"
            )
            + _prefix_unknown(d, model)
            + _predicted_note(d["matches"])
        )
        # OUT OF ROUTING: why the router would not choose the engine (cordoned, draining,
        # unreachable, ..., or the limit it lacks for this prompt), a column only when one
        # would not.
        aside = any(m.get("out_of_routing") for m in d["matches"])
        # ROLE: in a disaggregated fleet, which engines a prompt's prefix helps on which hop.
        roles = _disaggregated(m.get("role") for m in d["matches"])
        rows = [
            [
                m.get("instance_id"),
                m.get("engine"),
                *([m.get("role")] if roles else []),
                m.get("device_blocks", 0),
                m.get("host_blocks", 0),
                m.get("disk_blocks", 0),
                _cached_cell(m),
                *([m.get("out_of_routing")] if aside else []),
            ]
            for m in d["matches"]
        ]
        columns = ["ENGINE", "ADDRESS", *(["ROLE"] if roles else [])]
        columns += ["DEVICE BLOCKS", "HOST BLOCKS", "DISK BLOCKS"]
        columns += ["CACHED TOKENS", *(["OUT OF ROUTING"] if aside else [])]
        return head + "\n" + _table(columns, rows)

    emit(data, output, render)


# In a disaggregated fleet, what the engine `route` names is to the request.
_HOP_NOTES = {
    "prefill": "\nprefill hop: this prefill engine computes the prompt's KV; a decode engine is "
    "chosen by load when it hands the KV session over",
    "decode_prefill": "\nno prefill hop: this decode engine prefills the prompt itself (it holds "
    "router.skip_prefill_ratio of it, or no prefill engine takes traffic)",
}


def _disaggregated(roles: Iterable[str | None]) -> bool:
    """Whether any of the engines' roles is a disaggregated one (prefill or decode)."""
    return any(role in ("prefill", "decode") for role in roles)


def route(
    ctx: typer.Context,
    *,
    prompt: PromptOpt = None,
    tokens_file: TokensFileOpt = None,
    model: ModelOpt = None,
    lora: LoraOpt = "",
    cache_salt: CacheSaltOpt = "",
    bypass_prefix_cache: Annotated[
        bool,
        typer.Option(
            "--bypass-prefix-cache",
            help="As a request with kv.bypass_prefix_cache, which reads no cached prefix: "
            "every engine counts 0 cached tokens, the prompt is placed by load.",
        ),
    ] = False,
    session_key: Annotated[
        str | None,
        typer.Option(
            "--session-key",
            help="As a request carrying this session key (the value of its "
            "router.session_metadata_key metadata): sent where that session is bound, "
            "reason session.",
            callback=not_blank("a session key, or leave it out for a request of no session"),
        ),
    ] = None,
    target: ControllerTargetOpt = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Where the router would send a prompt, and every engine's cost terms (controller)."""
    query = _prompt_query(prompt, tokens_file, model, lora, cache_salt)
    query.bypass_prefix_cache = bypass_prefix_cache
    query.session_key = session_key or ""
    reply = _admin_call(
        "route", _server(ctx, target), lambda stub: stub.Route(query, timeout=RPC_TIMEOUT_S)
    )
    data = _dict(reply)
    data.setdefault("costs", [])

    def render(d: dict[str, Any]) -> str:
        head = (
            f"-> {d.get('instance_id')} ({d.get('engine')}) reason {d.get('reason')}, policy "
            f"{d.get('policy')}, predicted cached {d.get('predicted_cached_tokens', 0)} of "
            f"{d.get('num_prompt_tokens', 0)} tokens"
        ) + _prefix_unknown(d, model)
        head += _HOP_NOTES.get(d.get("hop", ""), "")
        if bypass_prefix_cache:
            # Why CACHED is 0 on every engine, even the one `match` shows holding the prompt.
            head += (
                "\nbypass_prefix_cache: the request reads no cached prefix, so it is placed by "
                "load with 0 cached tokens on every engine"
            )
        head += _predicted_note(d["costs"])
        head += _unweighed_note(d["costs"])
        sharers = d.get("hot_prefix_sharers", 0)
        if sharers:
            # Why an engine without the prefix shows a small PREFILL (the rule divided it).
            head += (
                f"\nhot prefix: {sharers} requests in flight share the cached prefix, so "
                f"recomputing it elsewhere costs the overlap weight / {sharers} "
                "(router.hot_prefix_requests)"
            )
        rows = [
            [
                c.get("instance_id"),
                _cached_cell(c),
                c.get("host_cached_tokens", 0),
                c.get("disk_cached_tokens", 0),
                _num(c.get("prefill_cost")),
                _num(c.get("queue_cost")),
                _num(c.get("decode_cost")),
                _num(c.get("memory_cost")),
                _num(c.get("total")),
                "busy" if c.get("busy") else "-",
            ]
            for c in d["costs"]
        ]
        return (
            head
            + "\n"
            + _table(
                [
                    "ENGINE",
                    "CACHED",
                    "HOST",
                    "DISK",
                    "PREFILL",
                    "QUEUE",
                    "DECODE",
                    "MEMORY",
                    "TOTAL",
                    "BUSY",
                ],
                rows,
            )
        )

    emit(data, output, render)


def _cached_cell(row: dict[str, Any]) -> str:
    """An engine's cached tokens, `(predicted)` for an engine without KV events."""
    cached = row.get("cached_tokens", 0)
    return f"{cached} (predicted)" if row.get("predicted") else str(cached)


def _predicted_note(rows: list[dict[str, Any]]) -> str:
    """The line saying what a predicted cache is, when an engine has one; else empty."""
    if not any(r.get("predicted") for r in rows):
        return ""
    return (
        "\n(predicted): an engine without KV events (kv_events approximate): what it holds is "
        "predicted from the prompts this controller routed there (router.approximate_ttl_s)"
    )


def _unweighed_note(rows: list[dict[str, Any]]) -> str:
    """The line saying what the cost columns hold when no engine was weighed (no row has a
    total: a cache-blind policy, or a decision its reason made, `only`, `session`,
    `all_busy`, a decode engine chosen by load): the engines' own figures, not the policy's
    weighted costs; else empty."""
    if not rows or any("total" in r for r in rows):
        return ""
    return (
        "\nnot weighed (no TOTAL): PREFILL is each engine's uncached prompt tokens, QUEUE its "
        "queued prefill tokens, DECODE its running requests"
    )


def _prefix_unknown(reply: dict[str, Any], model: str | None) -> str:
    """The lines saying why the engines' cached prefixes of the prompt are unknown: a text
    prompt that was not tokenized (no tokenizer for it, or too long), or an index that could
    not answer; empty when they are known."""
    lines = ""
    if not reply.get("tokenized"):
        which = f"model {model!r}" if model else "the default model"
        lines += (
            f"\nnot tokenized: no tokenizer configured for {which} (or the prompt is longer "
            "than tokenize_max_chars), so the prompt is routed without prefix knowledge (token "
            "counts estimated at 4 characters a token)"
        )
    if reply.get("index_error"):
        lines += (
            f"\nthe index could not answer ({reply['index_error']}): what the engines hold is "
            "unknown, so the prompt is routed by load and by the prompts this controller itself "
            "routed in the last seconds (router.pending_ttl_s)"
        )
    return lines


def _num(value: Any) -> str | None:
    return None if value is None else f"{float(value):.1f}"


# ---- actions ----


def drain(
    ctx: typer.Context,
    *,
    engine: Annotated[
        str | None,
        typer.Argument(help="Engine instance id or address (or give --self).", callback=a_name),
    ] = None,
    drain_self: Annotated[
        bool,
        typer.Option(
            "--self",
            help="Drain the target itself instead of one engine. A controller then refuses "
            "every new request, the whole fleet's, until it is restarted.",
        ),
    ] = False,
    deadline_ms: Annotated[
        int | None,
        typer.Option(
            "--deadline-ms",
            min=0,
            max=MAX_UINT32,
            help="Fail the drain if requests are still in flight after this many ms "
            "(default: wait for them all).",
        ),
    ] = None,
    abort_after_deadline: Annotated[
        bool,
        typer.Option(
            "--abort-after-deadline",
            help="At the deadline, abort what is still in flight and complete the drain.",
        ),
    ] = False,
    target: TargetOpt = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Drain an engine of the fleet, or with --self the target itself.

    Progress is shown until COMPLETE, each event as it comes (with --output json, one JSON
    object a line). A deadline that passes with requests in flight ends it with an error."""
    if (engine is None) == (not drain_self):
        raise typer.BadParameter(
            "give the ENGINE to drain or --self, not both"
            if drain_self
            else "give the ENGINE to drain, or --self to drain the target itself"
        )
    server = _server(ctx, target, token_file)
    events: list[dict[str, Any]] = []

    def follow(stream: Iterable[pb.DrainResponse]) -> None:
        for event in stream:
            data = _dict(event)
            events.append(data)
            # JSON Lines: each event as it comes (click flushes each line), for a script to
            # follow and to keep what came before a Ctrl-C or a broken stream.
            if output is OutputFormat.json:
                typer.echo(json.dumps(data, sort_keys=True))
            else:
                typer.echo(_render_drain(data))

    drained = f"engine {engine}" if engine is not None else server.address

    def left() -> str:
        """Ctrl-C stops following the drain, not the drain (the seed has no RPC that undoes
        one). Before its first event, whether the target got the request is not known."""
        if events:
            return f"the drain of {drained} goes on (leaving it does not undo it)"
        return (
            f"no reply to the drain of {drained} yet: `kvplane admin workers` or `health` "
            "shows whether it started"
        )

    try:
        with _said_if_interrupted(left):
            _follow_drain(
                server,
                engine,
                deadline_ms=deadline_ms,
                abort_after_deadline=abort_after_deadline,
                follow=follow,
            )
    except RpcCallError as exc:
        if not events:
            raise
        # The stream broke once the drain had started (the target's process died, the
        # network went): the drain is not undone by that, and may go on.
        raise RpcCallError(
            f"{exc} (the drain of {drained} had started: `kvplane admin workers` or `health` "
            "shows whether it goes on)"
        ) from None
    last = events[-1] if events else {}
    if "error" in last:
        raise RpcCallError(f"drain failed: {last['error'].get('message', '')}")


def _follow_drain(
    server: ClientTarget,
    engine: str | None,
    *,
    deadline_ms: int | None,
    abort_after_deadline: bool,
    follow: Callable[[Iterable[pb.DrainResponse]], None],
) -> None:
    """Start the drain of `engine` (DrainEngine; None: the target's own Drain) and `follow`
    its events."""
    if engine is not None:
        req = apb.DrainEngineRequest(engine=engine, abort_after_deadline=abort_after_deadline)
        if deadline_ms is not None:
            req.deadline_ms = deadline_ms
        _admin_call("drain ENGINE", server, lambda stub: follow(stub.DrainEngine(req)))
    else:
        dreq = pb.DrainRequest(
            stop_accepting_new_requests=True, abort_after_deadline=abort_after_deadline
        )
        if deadline_ms is not None:
            dreq.deadline_ms = deadline_ms
        _call(server, lambda ch: follow(pb_grpc.OpenEngineStub(ch).Drain(dreq)))


@contextmanager
def _said_if_interrupted(what_goes_on: Callable[[], str]) -> Iterator[None]:
    """A command that waits on what it started at the server (a drain, a registration):
    Ctrl-C stops the waiting, not what the server does, so `what_goes_on()` (as it is when
    interrupted) is said on stderr before the interrupt ends the command (exit 130), lest the
    operator take it for undone."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo(f"kvplane: interrupted: {what_goes_on()}", err=True)
        raise


def _render_drain(d: dict[str, Any]) -> str:
    if "error" in d:
        return f"error {d['error'].get('code')}: {d['error'].get('message', '')}"
    state = str(d.get("state", "")).removeprefix("DRAIN_STATE_")
    parts = [state]
    if "in_flight_requests" in d:
        parts.append(f"in flight {d['in_flight_requests']}")
    if "open_kv_sessions" in d:
        parts.append(f"kv sessions {d['open_kv_sessions']}")
    if d.get("message"):
        parts.append(d["message"])
    return "  ".join(parts)


def _engine_command(
    name: str,
    call: Callable[[apb_grpc.AdminStub], Callable[..., apb.WorkerInfo]],
    done: str,
    doc: str,
    *,
    says_if_unroutable: bool = False,
) -> Callable[..., None]:
    """`kvplane admin NAME ENGINE`: one admin RPC on one engine (`call` picks it from the
    stub), which answers the engine's WorkerInfo, shown as "ID (ADDRESS) DONE"; with
    `says_if_unroutable`, followed by the state that still keeps the engine out of routing."""

    def render(d: dict[str, Any]) -> str:
        line = f"{d.get('instance_id') or '-'} ({d.get('address')}) {done}"
        if says_if_unroutable and not d.get("routable"):
            state = d.get("state", "unknown")
            line += f"; still not routed: {state}"
            if state == "draining":  # the seed has no RPC that undoes an engine's Drain
                line += " (a drained engine takes traffic again once its process restarts)"
        return line

    def command(
        ctx: typer.Context,
        engine: Annotated[
            str, typer.Argument(help="Engine instance id or address.", callback=a_name)
        ],
        target: ControllerTargetOpt = None,
        token_file: TokenFileOption = None,
        output: OutputOption = OutputFormat.table,
    ) -> None:
        ref = apb.EngineRef(engine=engine)

        def rpc(stub: apb_grpc.AdminStub) -> apb.WorkerInfo:
            return call(stub)(ref, timeout=RPC_TIMEOUT_S)

        data = _dict(_admin_call(name, _server(ctx, target, token_file), rpc))
        emit(data, output, render)

    command.__doc__ = doc
    return command


# States in which the controller has no usable answer from an engine (yet): not reached, or
# answering its polls with errors (`failing`: it may still be starting, so it is waited for).
_NO_ANSWER_YET = frozenset({"unknown", "unreachable", "failing"})
REGISTER_POLL_S = 0.1


def register_engine(
    ctx: typer.Context,
    *,
    address: Annotated[
        str, typer.Argument(help="HOST:PORT of the engine, as the controller dials it.")
    ],
    kv_events: Annotated[
        KvEventsMode,
        typer.Option(
            "--kv-events",
            help="Where the controller takes the engine's KV events from (none: routed "
            "cache-blind; approximate: none either, its cache predicted from the prompts "
            "routed there).",
        ),
    ] = KvEventsMode.grpc,
    owner: Annotated[
        str,
        typer.Option(
            "--owner",
            help="Who registers the engine (RegisterEngine owner; shown as `owner` in "
            "--output json): a planner's Kubernetes actuator registers its engines as "
            "kubernetes:NAMESPACE/DEPLOYMENT, and takes out those of that owner no pod of the "
            "Deployment is at. Default: none.",
        ),
    ] = "",
    wait_s: Annotated[
        float,
        typer.Option(
            "--wait-s",
            min=0,
            callback=finite_number,
            help="Wait this long for the controller to reach the engine; one that it has not "
            "reached by then (or that it rejects) fails the command. 0: return at once.",
        ),
    ] = 10.0,
    target: ControllerTargetOpt = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Add an engine to the fleet at run time.

    It stays until `remove`; a controller restart keeps only its config's engines."""
    with usage_error_for("ADDRESS"):
        parse_dial_target(address)
    server = _server(ctx, target, token_file)
    req = apb.RegisterEngineRequest(address=address, kv_events=kv_events.value, owner=owner)
    reply = _admin_call(
        "register",
        server,
        lambda stub: stub.RegisterEngine(req, timeout=RPC_TIMEOUT_S),
    )
    data = _dict(reply)
    if wait_s > 0:
        stays = f"engine {address} stays registered (remove it: kvplane admin remove {address})"
        with _said_if_interrupted(lambda: stays):
            data = _wait_until_reached(server, address, wait_s)
    emit(data, output, lambda d: _render_workers({"workers": [d]}))


def _wait_until_reached(server: ClientTarget, address: str, wait_s: float) -> dict[str, Any]:
    """The engine's row once the controller has an answer from it (its identity and health);
    RpcCallError, naming the controller's last error, if it is rejected or still not reached
    after `wait_s`. The engine stays registered either way: the controller keeps retrying."""
    deadline = time.monotonic() + wait_s
    while True:
        listed = _admin_call(
            "register",
            server,
            lambda stub: stub.ListWorkers(apb.ListWorkersRequest(), timeout=RPC_TIMEOUT_S),
        )
        row = next((w for w in listed.workers if w.address == address), None)
        if row is None:
            raise RpcCallError(f"engine {address} left the fleet while it was being registered")
        if row.state == "incompatible":
            raise RpcCallError(
                f"engine {address} registered, but the controller rejects it: {row.last_error}"
                f" (remove it: kvplane admin remove {address})"
            )
        if row.state not in _NO_ANSWER_YET:
            return _dict(row)
        if time.monotonic() >= deadline:
            why = row.last_error or "no answer yet"
            outcome = (
                f"it still answers the controller's polls with errors after {wait_s:g}s"
                if row.state == "failing"
                else f"the controller has not reached it in {wait_s:g}s"
            )
            raise RpcCallError(
                f"engine {address} registered, but {outcome} ({why}); it keeps retrying "
                f"(remove it: kvplane admin remove {address})"
            )
        time.sleep(REGISTER_POLL_S)


def abort(
    ctx: typer.Context,
    *,
    request_id: Annotated[
        str | None, typer.Argument(help="The request to abort.", callback=a_name)
    ] = None,
    all_requests: Annotated[bool, typer.Option("--all", help="Abort every request.")] = False,
    target: TargetOpt = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Abort a request (the controller forwards it to the engine holding it) or all.

    Behind a controller, `--all` shows every engine's outcome, and exits 1 naming the engines
    that did not abort their requests (stopped, wedged, refusing)."""
    if (request_id is None) == (not all_requests):
        raise typer.BadParameter(
            "give a REQUEST_ID or --all" + (", not both" if all_requests else "")
        )
    req = (
        pb.AbortRequest(all_requests=pb.AllRequests())
        if request_id is None
        else pb.AbortRequest(request_id=request_id)
    )
    server = _server(ctx, target, token_file)
    data = _fanout_call(server, lambda stub: stub.Abort.with_call(req, timeout=RPC_TIMEOUT_S))

    def render(d: dict[str, Any]) -> str:
        if "error" in d:
            return f"{d['error']['code']}: {d['error']['message']}"
        return f"{d.get('status', 'ABORT_STATUS_UNSPECIFIED')} {d.get('message', '')}".rstrip()

    emit(data, output, render)
    # For scripts: an engine that did not abort may still run requests (its message and
    # JSON entry above say which), whether or not the controller failed the call.
    engines = data.get("engines", ())
    failed = [f"{e['engine']} ({e['outcome']})" for e in engines if e.get("outcome", "ok") != "ok"]
    # The outcomes that did not fit come after the failures (controller.outcomes): once one
    # listed is ok, so is every one left out; else theirs are unknown.
    left_out = sum(e.get("truncated", 0) for e in engines)
    if left_out and not any(e.get("outcome") == "ok" for e in engines):
        failed.append(f"{left_out} more engines")
    if failed:
        raise RpcCallError(
            f"not every request was aborted: {', '.join(failed)} did not abort theirs"
        )
    _fail_on_error(server, data)


lora_app = typer.Typer(no_args_is_help=True, help="LoRA adapters on the fleet or an engine.")


def _engine_metadata(
    command: str, server: ClientTarget, engine: str | None, model: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The request metadata that has the controller `server` forward a LoRA call to fleet
    engine `engine` only, to the engines serving `model`, or to that engine for that model
    (controller.outcomes); none without either. The target must be a controller: an engine
    ignores metadata it does not know and would act on itself, whatever `engine` or `model`
    names."""
    if engine is None and model is None:
        return ()
    _admin_call(
        command,
        server,
        lambda stub: stub.ListWorkers(apb.ListWorkersRequest(), timeout=RPC_TIMEOUT_S),
    )
    named = () if engine is None else ((ENGINE_METADATA_KEY, engine),)
    return named + lora_model_metadata(model)


def _fanout_call(
    server: ClientTarget, rpc: Callable[[pb_grpc.OpenEngineStub], tuple[Message, grpc.Call]]
) -> dict[str, Any]:
    """The reply of a call a controller fans out to its engines (Abort, the LoRA calls) as a
    dict, with `engines`: the controller's per-engine outcomes (its trailing metadata,
    controller.outcomes); absent against a single engine. A fan-out that failed reports them
    all the same: then `{"error": {"code", "message"}, "engines": [...]}`, printed as a
    success's is before the caller exits 1 (`_fail_on_error`), so that a script reads which
    engines did and which did not. Any other failure is one line."""

    def call(channel: grpc.Channel) -> dict[str, Any]:
        try:
            reply, call = rpc(pb_grpc.OpenEngineStub(channel))
        except grpc.RpcError as exc:
            if not isinstance(exc, grpc.Call) or not (
                outcomes := read_outcomes(exc.trailing_metadata())
            ):
                raise
            return {
                "error": {"code": exc.code().name, "message": exc.details()},
                "engines": outcomes,
            }
        data = _dict(reply)
        if engines := read_outcomes(call.trailing_metadata()):
            data["engines"] = engines
        return data

    return _call(server, call)


def _fail_on_error(server: ClientTarget, data: dict[str, Any]) -> None:
    """Exit 1, in one line, after a failed fan-out's outcomes were printed (`_fanout_call`)."""
    if "error" in data:
        error = data["error"]
        raise RpcCallError(f"{server.address}: {error['code']}: {error['message']}")


def _done(subject: str, done: str, data: dict[str, Any]) -> str:
    """`x loaded`; for a failed fan-out (`_fanout_call`) `x failed: CODE`, or `x loaded on
    some engines only: CODE` when some engine's outcome is ok: those did load (or unload) it,
    which "failed" alone would deny."""
    if "error" not in data:
        return f"{subject} {done}"
    code = data["error"]["code"]
    if any(e.get("outcome") == "ok" for e in data.get("engines", ())):
        return f"{subject} {done} on some engines only: {code}"
    return f"{subject} failed: {code}"


def _with_engines(summary: str, data: dict[str, Any]) -> str:
    """A one-line summary, then one line per engine of the fleet (when behind a controller)."""
    lines = [summary]
    for e in data.get("engines", ()):
        if "truncated" in e:
            lines.append(f"  ... {e['truncated']} more engines (their outcomes did not fit)")
            continue
        line = f"  {e.get('instance_id') or e['engine']} ({e['engine']}): {e['outcome']}"
        if e.get("detail"):
            line += f", {e['detail']}"
        if e.get("adapters") is not None:
            line += f" [{', '.join(e['adapters'])}]"
        lines.append(line)
    return "\n".join(lines)


@lora_app.command("load")
def lora_load(
    ctx: typer.Context,
    *,
    name: Annotated[str, typer.Argument(help="Adapter name.")],
    path: Annotated[str, typer.Argument(help="Absolute adapter directory, as the engine sees it.")],
    lora_id: Annotated[
        int, typer.Option("--id", min=1, max=INT64_MAX, help="Positive adapter id.")
    ],
    engine: EngineOpt = None,
    model: LoraModelOpt = None,
    target: TargetOpt = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Load an adapter on every engine, on one (--engine), or on one model's (--model).

    Through a controller, --engine and --model together load it on that engine for that base
    model. Behind a controller, each engine's outcome is shown."""
    server = _server(ctx, target, token_file)
    command = "lora load --engine" if model is None else "lora load --model"
    metadata = _engine_metadata(command, server, engine, model)
    req = pb.LoadLoraRequest(
        adapter=pb.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=path)
    )
    data = _fanout_call(
        server,
        lambda stub: stub.LoadLora.with_call(req, metadata=metadata, timeout=RPC_TIMEOUT_S),
    )
    state = "already loaded" if data.get("already_loaded") else "loaded"
    emit(data, output, lambda d: _with_engines(_done(name, state, d), d))
    _fail_on_error(server, data)


@lora_app.command("unload")
def lora_unload(
    ctx: typer.Context,
    *,
    name: Annotated[str, typer.Argument(help="Adapter name.")],
    engine: EngineOpt = None,
    target: TargetOpt = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Unload an adapter everywhere, or through the controller from one engine.

    Behind a controller, each engine's outcome is shown."""
    server = _server(ctx, target, token_file)
    metadata = _engine_metadata("lora unload --engine", server, engine)
    req = pb.UnloadLoraRequest(lora_name=name)
    data = _fanout_call(
        server,
        lambda stub: stub.UnloadLora.with_call(req, metadata=metadata, timeout=RPC_TIMEOUT_S),
    )
    emit(data, output, lambda d: _with_engines(_done(name, "unloaded", d), d))
    _fail_on_error(server, data)


@lora_app.command("list")
def lora_list(
    ctx: typer.Context, target: TargetOpt = None, output: OutputOption = OutputFormat.table
) -> None:
    """Adapters loaded on any engine of the fleet.

    Behind a controller, which engines hold each (ENGINES)."""
    server = _server(ctx, target)
    data = _fanout_call(
        server,
        lambda stub: stub.ListLoras.with_call(pb.ListLorasRequest(), timeout=RPC_TIMEOUT_S),
    )
    if "error" in data:
        emit(data, output, lambda d: _with_engines(f"the listing failed: {d['error']['code']}", d))
        _fail_on_error(server, data)
    data.setdefault("adapters", [])
    holders: dict[str, list[str]] = {}
    for e in data.get("engines", ()):
        for adapter in e.get("adapters") or ():  # a {"truncated": N} entry names none
            holders.setdefault(adapter, []).append(e.get("instance_id") or e["engine"])

    def render(d: dict[str, Any]) -> str:
        headers = ["ID", "NAME", "PATH"] + (["ENGINES"] if "engines" in d else [])
        rows = []
        for a in d["adapters"]:
            row = [a.get("lora_id"), a.get("lora_name"), a.get("source_path")]
            if "engines" in d:
                # Sorted: the engines' outcomes come in the order they answered.
                row.append(",".join(sorted(holders.get(a.get("lora_name", ""), []))))
            rows.append(row)
        return _table(headers, rows)

    emit(data, output, render)


def register(app: typer.Typer) -> None:
    """Add the admin commands to `kvplane admin`."""
    for name, fn in (
        ("workers", workers),
        ("health", health),
        ("load", load),
        ("info", info),
        ("match", match),
        ("route", route),
        ("drain", drain),
        ("abort", abort),
    ):
        app.command(name)(fn)
    app.command("register")(register_engine)
    app.command("remove")(
        _engine_command(
            "remove",
            lambda stub: stub.RemoveEngine,
            "removed",
            "Take an engine out of the fleet at once (`drain` it first).\n\n"
            "Requests running on it are not waited for, and what the index holds for it is "
            "forgotten. The engine process goes on.",
        )
    )
    app.command("cordon")(
        _engine_command(
            "cordon",
            lambda stub: stub.Cordon,
            "cordoned",
            "Stop routing new requests to an engine.",
        )
    )
    app.command("uncordon")(
        _engine_command(
            "uncordon",
            lambda stub: stub.Uncordon,
            "uncordoned",
            "Route to a cordoned engine again.\n\n"
            "An engine out of routing for another reason (draining, unreachable, ...) is "
            "said to be, with that state.",
            says_if_unroutable=True,
        )
    )
    app.add_typer(lora_app, name="lora")
