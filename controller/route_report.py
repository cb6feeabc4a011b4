"""Where the gateway ran a generation, told to its client. The seed's GenerateResponse has no
field naming the engine, so the gateway's Generate (OpenEngine's and vllm.Generate alike,
controller/relay.py) sends it in the call's trailing metadata, success or failure, once an
engine was chosen: one `kvplane-route` entry, a JSON object

    {"engine": ADDRESS, "instance_id": ID, "reason": REASON, "policy": POLICY,
     "predicted_cached_tokens": N, "retried": BOOL, "retried_from": [ADDRESS, ...],
     "prefill": {"engine": ..., "instance_id": ..., "reason": ..., "policy": ...,
                 "predicted_cached_tokens": N}}

`engine`..`predicted_cached_tokens`: the engine that served the request (a disaggregated
one's decode engine, or the decode engine that prefilled the prompt itself) and the router's
decision for it (controller/router `Decision`: why it was chosen, and the prompt tokens it was
expected to serve from its cache); `prefill`: the prefill engine of a request handed over
between two engines; `retried_from` (only when `retried`): the engines that failed or refused
the request before its first output, in order, each of which sent it elsewhere. A request
aborted at the handoff has `prefill` alone. llm-d's gateway names its chosen endpoint so, in a
response header (`x-gateway-destination-endpoint`); `kvplane complete` prints it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from controller.router import Decision

ROUTE_METADATA_KEY = "kvplane-route"
# Engines named in `retried_from` at most: with the one retry of a failed request there are one
# or two, but re-routes past refusals (an adapter unloaded under a request, a prompt maybe past
# an engine's context) are not bounded by it, and gRPC clients refuse trailing metadata over
# 8 KiB.
MAX_RETRIED_FROM = 8


# What of a request an engine hop runs: its prefill (handing the KV over), its decode (with
# that KV), or all of it (an aggregated engine, or a decode engine prefilling it itself).
Part = Literal["prefill", "decode", "whole"]


class RouteReport:
    """The `kvplane-route` entry of one gateway request, as its hops choose engines."""

    def __init__(self) -> None:
        self.served: dict[str, Any] | None = None
        self.prefill: dict[str, Any] | None = None
        self.retried_from: list[str] = []

    def chose(
        self, decision: Decision, instance_id: str, part: Part, *, failed: str | None
    ) -> None:
        """An engine hop chose `decision`'s engine (`instance_id`: its id as the registry
        knows it) for `part` of the request; `failed`: the engine that failed the request
        before its output and sent it here, if any. An engine running it whole takes the
        place of any prefill engine chosen before (which failed, or whose KV session was
        lost with it)."""
        hop = {
            "engine": decision.engine_id,
            "instance_id": instance_id,
            "reason": decision.reason.value,
            "policy": decision.policy,
            "predicted_cached_tokens": decision.predicted_cached_tokens,
        }
        if part == "prefill":
            self.prefill = hop
        else:
            self.served = hop
        if part == "whole":
            self.prefill = None
        if failed is not None and len(self.retried_from) < MAX_RETRIED_FROM:
            self.retried_from.append(failed)

    def metadata(self) -> list[tuple[str, str]]:
        """The trailing metadata of the request as far as it went."""
        entry: dict[str, Any] = dict(self.served or {})
        if self.prefill is not None:
            entry["prefill"] = self.prefill
        entry["retried"] = bool(self.retried_from)
        if self.retried_from:
            entry["retried_from"] = self.retried_from
        return [(ROUTE_METADATA_KEY, json.dumps(entry, sort_keys=True))]


def read_route(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, Any] | None:
    """The `kvplane-route` entry of a call's trailing metadata; None when there is none (a
    single engine answered, or the gateway refused the request before choosing one)."""
    for key, value in metadata or ():
        if key == ROUTE_METADATA_KEY:
            route: dict[str, Any] = json.loads(value)
            return route
    return None
