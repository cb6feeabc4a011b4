"""`kvplane admin index ...`: inspect a running indexer (stats, dump, match) over gRPC, and
have it rebuild an engine's entries (resync).

`--target HOST:PORT` names the indexer (on the group or on each command); `--tls-ca` and
friends (on this group or on `admin`) dial it with TLS; `--output json` prints
machine-readable results. RPC failures become one-line errors (exit code 1).
"""

from __future__ import annotations

import enum
import json
import re
import textwrap
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import grpc
import typer

from indexer.batch import to_sfixed64
from indexer.validation import MAX_UINT32
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.cli_common import (
    RPC_TIMEOUT_S,
    ClientTarget,
    GroupTokenFileOption,
    OutputFormat,
    OutputOption,
    TlsCaOption,
    TlsCertOption,
    TlsKeyOption,
    TlsServerNameOption,
    TokenFileOption,
    a_name,
    client_channels,
    emit,
    not_blank,
    remember_group_client,
    target_option,
    usage_error_for,
)
from kvplane.errors import KvplaneError
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_KIND = "a kvplane indexer"  # what --target must be (rpc_channel)

index_app = typer.Typer(no_args_is_help=True, help="Inspect a kvplane indexer.")

IndexTargetOption = Annotated[
    str | None, target_option("HOST:PORT of the indexer.", DEFAULT_TARGET)
]
T = TypeVar("T")


@index_app.callback()
def _group(
    ctx: typer.Context,
    *,
    target: IndexTargetOption = None,
    tls_ca: TlsCaOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_server_name: TlsServerNameOption = None,
    token_file: GroupTokenFileOption = None,
) -> None:
    channels = client_channels(tls_ca, tls_cert, tls_key, tls_server_name)
    remember_group_client(ctx, target, channels, token_file)


def _channel(
    ctx: typer.Context, target: str | None, token_file: Path | None
) -> AbstractContextManager[grpc.Channel]:
    """A channel to the command's --target, else the groups', else DEFAULT_TARGET, with the
    groups' --tls-* options, every call carrying the command's --token-file's token, else
    the groups' (`ClientTarget.of`)."""
    return ClientTarget.of(ctx, target, DEFAULT_TARGET, token_file).channel(TARGET_KIND)


def _call(
    ctx: typer.Context,
    target: str | None,
    token_file: Path | None,
    rpc: Callable[[grpc.Channel], T],
) -> T:
    with _channel(ctx, target, token_file) as channel:
        return rpc(channel)


def _as_dict(message: Any) -> dict[str, Any]:
    """A message as JSON-ready data; 64-bit integers stay numbers (protobuf's JSON mapping
    would quote them) and enums are names."""
    data: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            if field.is_repeated:
                data[field.name] = [_as_dict(v) for v in value]
            elif message.HasField(field.name):
                data[field.name] = _as_dict(value)
            continue
        if field.has_presence and not field.is_repeated and not message.HasField(field.name):
            data[field.name] = None
            continue
        if field.enum_type is not None:
            names = field.enum_type.values_by_number
            if field.is_repeated:
                data[field.name] = [names[v].name if v in names else v for v in value]
            else:
                data[field.name] = names[value].name if value in names else value
        else:
            data[field.name] = list(value) if field.is_repeated else value
    return data


@index_app.command()
def stats(
    ctx: typer.Context,
    target: IndexTargetOption = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Blocks, placements and workers in the index."""
    response = _call(
        ctx,
        target,
        token_file,
        lambda ch: api_grpc.KvIndexStub(ch).GetIndexStats(
            api.GetIndexStatsRequest(), timeout=RPC_TIMEOUT_S
        ),
    )

    def render(data: dict[str, Any]) -> str:
        lines = [
            f"backend {data['backend']}: {data['num_blocks']} blocks, "
            f"{data['num_placements']} placements, {data['num_workers']} workers, "
            f"{data['num_batches_applied']} batches applied, "
            f"{data['num_events_dropped']} events dropped"
        ]
        for w in data["workers"]:
            lines.append(
                f"  {w['worker_id']:<24} {w['worker_address'] or '-':<24} "
                f"{w['num_blocks']:>10} blocks {w['num_placements']:>10} placements"
            )
        for k in data["keyings"]:
            keyed = k["key_space"] or "the engine's own hashes (no vllm_hash declared)"
            seed = "" if k["hash_seed"] is None else f", hash seed {k['hash_seed']!r}"
            root = k.get("root_block")
            seen = "" if not root else f"; its latest plain prompt root block: key {root['key']}"
            lines.append(f"  {k['worker_id']:<24} keyed {keyed}{seed}{seen}")
        return "\n".join(lines)

    emit(_as_dict(response), output, render)


@index_app.command()
def resync(
    ctx: typer.Context,
    engine: Annotated[
        str, typer.Argument(help="The engine's address (or its worker id).", callback=a_name)
    ],
    target: IndexTargetOption = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Drop ENGINE's entries and rebuild them from its sources.

    Every entry of ENGINE is dropped now and the indexer's sources that follow it
    resubscribe from a snapshot (what a controller does when it sees the engine restart).
    An indexer replica that does not hold the engine's writer lease hands it to the one that
    does (named in the answer), which does it at its next lease renewal."""
    response = _call(
        ctx,
        target,
        token_file,
        lambda ch: api_grpc.KvIndexStub(ch).ResyncEngine(
            api.ResyncEngineRequest(engine=engine), timeout=RPC_TIMEOUT_S
        ),
    )

    def render(data: dict[str, Any]) -> str:
        dropped = data["dropped_worker_ids"]
        return (
            f"{engine}: {len(dropped)} worker(s) dropped"
            + (f" ({', '.join(dropped)})" if dropped else "")
            + f", {data['sources_resubscribed']} source(s) resubscribing"
            + (
                f"; handed to {', '.join(data['handed_to'])} (holding its writer lease)"
                if data["handed_to"]
                else ""
            )
        )

    emit(_as_dict(response), output, render)


@index_app.command()
def dump(
    ctx: typer.Context,
    worker_id: Annotated[
        str | None,
        typer.Option(
            help="Only this worker (default: all).",
            callback=not_blank("a worker id, or leave it out for every worker"),
        ),
    ] = None,
    target: IndexTargetOption = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """The index as parent-first ApplyExternalKvBatch requests (replayable)."""
    with _channel(ctx, target, token_file) as channel:
        # Printed batch by batch as they arrive, with no deadline: a large index takes as long
        # as it takes, and is never held in memory whole.
        stream = api_grpc.KvIndexStub(channel).DumpIndex(
            api.DumpIndexRequest(worker_id=worker_id or "")
        )
        batches = (_as_dict(batch) for batch in stream)
        if output is OutputFormat.json:
            _echo_json_array(batches)
        else:
            _echo_dump_table(batches, worker_id)


def _echo_json_array(items: Iterable[dict[str, Any]]) -> None:
    """Print `items` one by one as the same JSON array `emit` prints for a list."""
    opening = "["
    for item in items:
        text = json.dumps(item, indent=2, sort_keys=True, default=str)
        typer.echo(f"{opening}\n{textwrap.indent(text, '  ')}", nl=False)
        opening = ","
    typer.echo("[]" if opening == "[" else "\n]")


def _echo_dump_table(batches: Iterable[dict[str, Any]], worker_id: str | None) -> None:
    empty = True
    for batch in batches:
        empty = False
        typer.echo(f"worker {batch['worker_id']} ({batch['worker_address'] or '-'})")
        for action in batch["actions"]:
            parent = action.get("parent_block_hash")
            typer.echo(
                f"  {action['type']:<26} {action['tier']:<9} {len(action['hashes'])} hashes"
                + (f" parent {parent}" if parent is not None else "")
            )
    if empty:
        typer.echo(f"(no entries of worker {worker_id})" if worker_id else "(empty index)")


# What a --tokens-file may hold (both admin CLIs' help and errors say the same).
TOKENS_FILE_FORMATS = (
    'a JSON array, a JSON object with "token_ids" or "prompt_token_ids", '
    "or ids separated by spaces, commas or newlines"
)


def read_token_ids(path: Path) -> list[int]:
    """The token ids of a `--tokens-file` (both admin CLIs): a JSON array, a JSON object with
    `token_ids` or `prompt_token_ids` (as vLLM logs requests), or ids separated by spaces,
    commas or newlines; each an integer in the proto's uint32 range, at least one. A file
    missing, unreadable, empty or holding anything else is a usage error naming the option."""
    with usage_error_for("--tokens-file"):
        return _token_ids_in(path)


def _token_ids_in(path: Path) -> list[int]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise KvplaneError(f"cannot read {path}: {reason}") from exc
    invalid = KvplaneError(
        f"{path} must hold token ids ({TOKENS_FILE_FORMATS}), integers in 0..{MAX_UINT32}"
    )
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        try:
            loaded = [int(t) for t in re.split(r"[\s,]+", text.strip()) if t]
        except ValueError:
            raise invalid from None
    if isinstance(loaded, dict):
        loaded = loaded.get("token_ids", loaded.get("prompt_token_ids"))
    if not isinstance(loaded, list) or not all(type(t) is int for t in loaded):
        raise invalid
    if not loaded:
        # An empty prompt, as a blank --prompt is: nothing to match, route or complete.
        raise KvplaneError(f"{path} holds no token ids")
    bad = next((t for t in loaded if not 0 <= t <= MAX_UINT32), None)
    if bad is not None:
        raise KvplaneError(f"{path}: token id {bad} is out of range (0 to {MAX_UINT32})")
    return loaded


def _parse_hashes(values: list[str]) -> list[int]:
    """Block hashes as engines print them (signed or unsigned 64-bit, decimal or 0x...), in
    the seed's sfixed64 space (`to_sfixed64`: 2**64 - 1 -> -1)."""
    out = []
    for value in values:
        for part in re.split(r"[\s,]+", value.strip()):
            if part:
                try:
                    out.append(to_sfixed64(int(part, 0)))
                except ValueError:
                    raise typer.BadParameter(
                        f"not a 64-bit integer hash: {part!r}", param_hint="--hashes"
                    ) from None
    return out


class HashChoice(enum.StrEnum):
    """`--hash`: the key space MatchTokens hashes the prompt into."""

    canonical = "canonical"
    sha256 = "sha256"
    sha256_cbor = "sha256_cbor"


_KEY_SPACES = {
    HashChoice.canonical: api.KEY_SPACE_CANONICAL,
    HashChoice.sha256: api.KEY_SPACE_VLLM_SHA256,
    HashChoice.sha256_cbor: api.KEY_SPACE_VLLM_SHA256_CBOR,
}


def _parse_mm_item(value: str) -> api.MultimodalItem:
    item_id, sep, span = value.rpartition(":")
    item_id, sep2, offset = item_id.rpartition(":")
    try:
        if not (sep and sep2 and item_id) or int(span) < 1:  # an item covers some tokens
            raise ValueError
        return api.MultimodalItem(id=item_id, offset=int(offset), length=int(span))
    except ValueError:
        raise typer.BadParameter(
            f"expected ID:OFFSET:LENGTH with LENGTH at least 1, got {value!r}",
            param_hint="--mm-item",
        ) from None


@index_app.command()
def match(
    ctx: typer.Context,
    *,
    tokens_file: Annotated[
        Path | None, typer.Option(help=f"Prompt token ids: {TOKENS_FILE_FORMATS}.")
    ] = None,
    block_size: Annotated[
        int, typer.Option(min=0, max=MAX_UINT32, help="Tokens per block (0: server default).")
    ] = 0,
    lora_name: Annotated[str, typer.Option(help="LoRA adapter name.")] = "",
    cache_salt: Annotated[str, typer.Option(help="Cache salt.")] = "",
    hash_kind: Annotated[
        HashChoice,
        typer.Option(
            "--hash",
            help="Key space of --tokens-file: canonical (kvplane's keys), or vLLM's own "
            "block hashes (sha256 or sha256_cbor) for workers indexed with `hash: engine`.",
        ),
    ] = HashChoice.canonical,
    hash_seed: Annotated[
        str | None,
        typer.Option(help="vLLM's PYTHONHASHSEED value (default: vLLM's default seed)."),
    ] = None,
    mm_item: Annotated[
        list[str] | None,
        typer.Option(
            help="A multimodal item of the prompt as ID:OFFSET:LENGTH (placeholder tokens "
            "[OFFSET, OFFSET+LENGTH)); repeat in prompt order."
        ),
    ] = None,
    hashes: Annotated[
        list[str] | None,
        typer.Option(help="Block hashes in prompt order (repeat, or comma-separated)."),
    ] = None,
    target: IndexTargetOption = None,
    token_file: TokenFileOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Which workers hold a prompt's prefix.

    By tokens (MatchTokens) or by block hashes (MatchExternalKvPrefix)."""
    if (tokens_file is None) == (not hashes):
        raise typer.BadParameter("give exactly one of --tokens-file or --hashes")
    if tokens_file is not None:
        request = api.MatchTokensRequest(
            token_ids=read_token_ids(tokens_file),
            block_size=block_size,
            lora_name=lora_name,
            cache_salt=cache_salt,
            key_space=_KEY_SPACES[hash_kind],
            hash_seed=hash_seed,
            mm_items=[_parse_mm_item(v) for v in mm_item or []],
        )
        response: Any = _call(
            ctx,
            target,
            token_file,
            lambda ch: api_grpc.KvIndexStub(ch).MatchTokens(request, timeout=RPC_TIMEOUT_S),
        )

        def render_tokens(data: dict[str, Any]) -> str:
            lines = [f"{data['num_query_blocks']} query blocks"]
            for m in data["matches"]:
                tiers = ", ".join(f"{t['tier']}={t['matched_blocks']}" for t in m["tiers"])
                # Blocks that continue the prefix on disk past the servable ones.
                disk = max(m.get("any_tier_blocks", 0) - m["matched_blocks"], 0)
                lines.append(
                    f"  {m['worker_id']:<24} {m['worker_address'] or '-':<24} "
                    f"{m['matched_blocks']:>6} blocks {m['matched_tokens']:>8} tokens  {tiers}"
                    + (f"  +{disk} on disk" if disk else "")
                )
            return "\n".join(lines)

        emit(_as_dict(response), output, render_tokens)
        return
    keys = _parse_hashes(hashes or [])
    if not keys:
        raise typer.BadParameter("--hashes is empty")
    prefix_request = kv.MatchExternalKvPrefixRequest(hashes=keys)
    response = _call(
        ctx,
        target,
        token_file,
        lambda ch: kv_grpc.KVIndexerStub(ch).MatchExternalKvPrefix(
            prefix_request, timeout=RPC_TIMEOUT_S
        ),
    )

    def render_prefix(data: dict[str, Any]) -> str:
        lines = [f"best prefix {data['best_prefix_blocks']} of {len(keys)} blocks"]
        for m in data["matches"]:
            lines.append(
                f"  {m['worker_id']:<24} {m['worker_address']:<24} "
                f"{m['matched_prefix_blocks']:>6} blocks"
            )
        return "\n".join(lines)

    emit(_as_dict(response), output, render_prefix)
