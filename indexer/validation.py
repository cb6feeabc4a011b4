"""kv_indexer.v1's request validation (WIRE.md section 2), shared by every backend and adapter.

Each check raises `IndexRequestError`, whose `kind` tells the servicer which status to send
(INVALID_ARGUMENT or RESOURCE_EXHAUSTED); nothing here touches state, so a rejected request
changes nothing. Values are checked as plain ints, so adapters may pass unconverted wire enums.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NoReturn

from indexer.batch import ActionType, Batch, BlockKey, CacheSpec, Tier
from indexer.multimodal import MultimodalItem
from kvplane.errors import KvplaneError

MAX_ACTIONS_PER_BATCH = 256
MAX_HASHES_PER_REQUEST = 16_384
# Worker ids and addresses are names, echoed in every answer and stored per worker (the Redis
# backend interns them): bounded, printable text.
MAX_WORKER_ID_CHARS = 256
# The wire's width of masks, token counts and cache-spec fields (and of the Redis backend's
# records). Values from adapters that do not go through the proto (ZMQ) are checked against it
# here, so that nothing out of range reaches a backend or an encoder.
MAX_UINT32 = (1 << 32) - 1
_MIN_KEY, _MAX_KEY = -(1 << 63), (1 << 63) - 1  # sfixed64

_ACTION_VALUES = frozenset(int(a) for a in ActionType)
_TIER_VALUES = frozenset(int(t) for t in Tier)
_REPORT, _CLEAR = int(ActionType.REPORT), int(ActionType.CLEAR_ALL_AT_TIER)


class ValidationKind(enum.Enum):
    """How an adapter reports a rejected request: the gRPC code it maps to."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"


class IndexRequestError(KvplaneError):
    """A request that breaks kv_indexer.v1's validation rules; nothing was changed."""

    def __init__(self, kind: ValidationKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _invalid(message: str) -> IndexRequestError:
    return IndexRequestError(ValidationKind.INVALID_ARGUMENT, message)


def validate_tier(value: int) -> Tier:
    """A wire tier as a `Tier`; TIER_UNKNOWN (0) and unknown values are INVALID_ARGUMENT."""
    if value not in (1, 2, 3):
        raise _invalid(f"tier must be HBM, DRAM or SSD, got {value}")
    return Tier(value)


def validate_action_type(value: int) -> ActionType:
    """A wire action type; ACTION_UNKNOWN (0) and unknown values are INVALID_ARGUMENT."""
    if value not in (1, 2, 3):
        raise _invalid(f"action type must be REPORT, REVOKE or CLEAR_ALL_AT_TIER, got {value}")
    return ActionType(value)


def worker_name_problem(field: str, value: str) -> str | None:
    """Why `value` cannot be a worker's id or address (`field`, named in the message): longer
    than MAX_WORKER_ID_CHARS, or holding a character that is not printable (NUL, control
    characters, line breaks); None when it can. An empty id is refused apart (an address may
    be empty). For config models too, so that a source's names are ones the index takes."""
    if len(value) > MAX_WORKER_ID_CHARS:
        return f"{field} must be at most {MAX_WORKER_ID_CHARS} characters, got {len(value)}"
    if not value.isprintable():
        return f"{field} must be printable text, got {value!r}"
    return None


def validate_batch(batch: Batch) -> None:
    """ApplyExternalKvBatch's rules, checked before any state changes (WIRE.md section 2),
    plus kvplane's own on the worker's names (`worker_name_problem`). In SGLang's order: the
    worker id, the batch's size (actions, then hashes), then each action's own rules, then
    the parent each REPORT states (no head block its own parent; a chain that loops further
    down is not looked for: docs/indexer.md).

    On every apply's path: the hash total, then one pass, each action unpacked once; the error
    message (and the action's position in it) is worked out only for a batch that fails."""
    actions = batch.actions
    if not batch.worker_id or type(batch.worker_id) is not str:
        raise _invalid("worker_id must be a non-empty string")
    problem = worker_name_problem("worker_id", batch.worker_id) or worker_name_problem(
        "worker_address", batch.worker_address
    )
    if problem is not None:
        raise _invalid(problem)
    if batch.cache_spec is not None:
        _check_spec(batch.cache_spec)
    if len(actions) > MAX_ACTIONS_PER_BATCH:
        raise IndexRequestError(
            ValidationKind.RESOURCE_EXHAUSTED,
            f"{len(actions)} actions in one batch; at most {MAX_ACTIONS_PER_BATCH}",
        )
    # The hash total before any action's own rules, as SGLang's indexer checks them: a batch
    # too large is RESOURCE_EXHAUSTED whatever else is wrong with it (a CLEAR's hashes are
    # ignored, so not counted).
    num_hashes = sum([len(action[2]) for action in actions if action[0] != _CLEAR])
    if num_hashes > MAX_HASHES_PER_REQUEST:
        raise IndexRequestError(
            ValidationKind.RESOURCE_EXHAUSTED,
            f"{num_hashes} hashes in one batch; at most {MAX_HASHES_PER_REQUEST}",
        )
    self_parent = None  # the first REPORT stating its head block as its own parent
    for action in actions:
        kind, tier, hashes, masks, sizes, _parent, _copies = action
        if kind not in _ACTION_VALUES:
            validate_action_type(kind)
        if tier not in _TIER_VALUES:
            validate_tier(tier)
        if kind == _CLEAR:
            continue  # its hashes, masks and sizes are ignored (the seed), so not checked
        if kind != _REPORT:
            # component_masks, block_sizes and parent_block_hash are REPORT-only: a REVOKE
            # ignores them (the seed), so their lengths and values are no reason to refuse it.
            masks = sizes = ()
            _parent = None
        n = len(hashes)
        if not n or (masks and len(masks) != n) or (sizes and len(sizes) != n):
            # The first equal action is this one: an equal one before it would have failed.
            _shape_error(actions.index(action), n, len(masks), len(sizes))
        # Keys as sfixed64 (in-process callers, e.g. tests, may pass anything): min / max
        # over the tuple is the cheap check; a non-int key fails it with a TypeError.
        try:
            keys_ok = min(hashes) >= _MIN_KEY and max(hashes) <= _MAX_KEY
            keys_ok = keys_ok and (_parent is None or _MIN_KEY <= _parent <= _MAX_KEY)
        except TypeError:
            keys_ok = False
        if not keys_ok:
            _range_error(actions.index(action), "hashes and parent_block_hash must be sfixed64")
        if (masks and (min(masks) < 0 or max(masks) > MAX_UINT32)) or (
            sizes and (min(sizes) < 0 or max(sizes) > MAX_UINT32)
        ):
            _range_error(actions.index(action), "component_masks and block_sizes must be uint32")
        if self_parent is None and kind == _REPORT and _parent == hashes[0]:
            # One comparison: SGLang's indexer also refuses a hash repeated down the chain or
            # a parent further down it, but a set per REPORT cost a fifth of a 64-block
            # REPORT's ingestion; such a REPORT changes no match here (docs/indexer.md).
            self_parent = action
    if self_parent is not None:  # after every action's shape, as SGLang's backend checks parents
        raise _invalid(f"action {actions.index(self_parent)}: block hash cannot be its own parent")


def _shape_error(i: int, n: int, num_masks: int, num_sizes: int) -> NoReturn:
    if n == 0:
        raise _invalid(f"action {i}: REPORT/REVOKE needs at least one hash")
    if num_masks and num_masks != n:
        raise _invalid(f"action {i}: {num_masks} component_masks for {n} hashes")
    raise _invalid(f"action {i}: {num_sizes} block_sizes for {n} hashes")


def _range_error(i: int, rule: str) -> NoReturn:
    raise _invalid(f"action {i}: {rule} values")


def _check_spec(spec: CacheSpec) -> None:
    for name in spec.__slots__:
        value = getattr(spec, name)
        if not 0 <= value <= MAX_UINT32:
            raise _invalid(f"cache_spec.{name} must be a uint32, got {value}")


def validate_match(hashes: Sequence[BlockKey]) -> None:
    """MatchExternalKv and GetExternalKvHitCounts: 1..16,384 hashes."""
    if not hashes:
        raise _invalid("hashes must not be empty")
    if len(hashes) > MAX_HASHES_PER_REQUEST:
        raise IndexRequestError(
            ValidationKind.RESOURCE_EXHAUSTED,
            f"{len(hashes)} hashes in one request; at most {MAX_HASHES_PER_REQUEST}",
        )


def validate_prefix_match(hashes: Sequence[BlockKey]) -> None:
    """MatchExternalKvPrefix: at least one hash, no length cap (only `max_blocks`)."""
    if not hashes:
        raise _invalid("hashes must not be empty")


def validate_mm_items(items: Sequence[MultimodalItem], num_tokens: int) -> None:
    """MatchTokens' `mm_items` for a prompt of `num_tokens` tokens: each has an id and starts
    inside the prompt, and its range `[offset, offset + length)` fits a uint32 (the wire's
    width; a client computing the end in uint32 would wrap). Order and lengths are
    `indexer.multimodal.block_items`' own preconditions."""
    for i, item in enumerate(items):
        if not item.id:
            raise _invalid(f"mm_items[{i}]: id must not be empty")
        if item.offset >= num_tokens:
            raise _invalid(
                f"mm_items[{i}]: offset {item.offset} is past the end of the prompt "
                f"({num_tokens} tokens)"
            )
        if item.offset + item.length > MAX_UINT32:
            raise _invalid(
                f"mm_items[{i}]: offset {item.offset} + length {item.length} overflows a uint32"
            )
