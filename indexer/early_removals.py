"""Which buffered removals may be applied ahead of the batches buffered before them, with the
same final index as applying every buffered batch in order (the Redis backend at its
`maxmemory`, where only removals may be written: `RedisBackend._release_buffered`).

Why these and no others. The index's effect of an action (WIRE.md section 2, indexer/index.py,
kvp_apply in indexer/redis_functions.lua) touches, besides the worker's address and spec:

- REPORT of (worker, tier, k...): the placement (mask replaced, one copy more with `copies`);
  the block's record, created if no live placement holds it (then without its old hit count,
  token count and parent), its token count (replaced only by a non-zero size) and parent
  (replaced only by a known one; a REPORT that states none for its first block keeps the one
  the worker stated, and only while the worker still holds that block).
- REVOKE of (worker, tier, k): that one placement (one copy less with `copies`); the block,
  with its hit count, token count and parent, when its last live placement goes.
- CLEAR of (worker, tier): every placement of the worker at that tier, so every block the
  worker holds there, whichever they are: this process does not know them.

Two removals commute: each only drops or decrements placements, a block goes exactly when its
last placement does, whatever the order, and nothing of a block that stays is touched. A
REVOKE of k commutes with a REPORT that does not name k among its blocks: they touch other
records. A REPORT naming k only as its parent (the block before its first) stores that key in
its own blocks' records and needs k neither present nor absent; masks, copies and token counts
are per block; hit counts change only with queries that count hits, refused at maxmemory. A
REVOKE of k does not commute with an earlier REPORT of k, of any tier and any worker: on the
same placement the order decides whether it is left, or how many copies; on another placement
of the block, applying the REVOKE first may delete the block (it was the last live placement
before the REPORT) and the REPORT then starts it afresh, without the hit count, token count
and parent it kept in order (and without the parent a worker's REPORT keeps for a block it
still holds). A CLEAR does not commute with an earlier REPORT of its worker on any tier (the
same argument for every block it may clear), nor with another worker's REPORT of a block it
clears, which cannot be told here.

Nor may a REVOKE of k pass another placement's earlier REPORT of k where the block would stay
(another live placement holds it as the REVOKE applies): other processes sharing the index
apply their own early removals meanwhile, and may end the block before this process replays the
REPORT, which then starts it afresh; however their removals interleave with this process's
batches applied in order (the REPORT first), the REVOKE's placement holds the block for the
REPORT, which keeps its hit count (and its token count and parent where it states none). A hit
counted once Redis takes writes, before the REPORT is replayed, and then deleted with the
block, makes even a REPORT that states both differ. docs/redis.md ("Redis at its `maxmemory`")
has the whole argument.

Hence a removal goes early iff it commutes with every action buffered before it: a REVOKE
of a block that no buffered REPORT before it names, of any worker (a REVOKE naming several
blocks goes early for those, and waits for the others); a CLEAR before which no REPORT at all
is buffered. Removals never wait for removals. Moving each early action, one after another,
before the actions it commutes with turns the buffered order into the early actions followed
by the rest, so the index after both is exactly the in-order one: every worker's placements,
masks, copies, address and spec, and every block's hit count, token count and parent. (A
CLEAR that only waited for its own worker's reports could pass another worker's REPORT of a
block it clears, which in order keeps the block's hit count and the rest: it would be as if
the sources' batches had arrived in another order, but not the order they did.)

The early actions of each batch are applied as one batch of its worker with its address, spec
and lease; kvp_release applies it only where Redis has the worker under that address and spec
already, so it changes neither (a worker new to Redis, or whose address or spec changed in the
buffer, has its removals wait). The batch stays in the buffer with the rest of its actions, so
that nothing is applied twice (a REVOKE with `copies` applied twice would drop two copies). A
batch left without actions is dropped, unless a batch of its worker that stays buffered before
it names another address or spec: that one applies after it, and the worker's last batch must
set them last.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from indexer.batch import Action, ActionType, Batch, BlockKey


class EarlySplit(NamedTuple):
    """A buffered batch split: `early` applies now; `rest` takes its place in the buffer
    once `early` is applied (None: the batch leaves the buffer)."""

    batch: Batch
    early: Batch
    rest: Batch | None


def early_removals(buffered: Sequence[Batch]) -> list[EarlySplit]:
    """The buffered batches (in order) holding removals that may apply ahead of the batches
    before them (see the module docstring), each split into those and the rest."""
    reported: set[BlockKey] = set()  # every block a buffered REPORT so far names
    staying: dict[str, Batch] = {}  # each worker's latest batch so far that stays buffered
    splits: list[EarlySplit] = []
    for batch in buffered:
        early: list[Action] = []
        rest: list[Action] = []
        for action in batch.actions:
            if action.type is ActionType.REPORT:
                rest.append(action)
                reported.update(action.hashes)
            elif action.type is ActionType.REVOKE:
                now = tuple(k for k in action.hashes if k not in reported)
                later = tuple(k for k in action.hashes if k in reported)
                if now:
                    early.append(action._replace(hashes=now))
                if later:
                    rest.append(action._replace(hashes=later))
            elif reported:
                rest.append(action)
            else:
                early.append(action)
        worker = batch.worker_id
        if not early:
            staying[worker] = batch
            continue
        before = staying.get(worker)
        left: Batch | None = batch._replace(actions=tuple(rest))
        if not rest and (before is None or _same_worker_info(before, batch)):
            left = None
        if left is not None:
            staying[worker] = left
        splits.append(EarlySplit(batch, batch._replace(actions=tuple(early)), left))
    return splits


def _same_worker_info(a: Batch, b: Batch) -> bool:
    """Whether applying `a` sets the worker's address and spec as `b` does."""
    return a.worker_address == b.worker_address and a.cache_spec == b.cache_spec
