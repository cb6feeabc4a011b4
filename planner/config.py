"""The planner's configuration: SLA targets, pools and the scaling rules' knobs.

```yaml
sla: {ttft_ms: 1000, itl_ms: 40}
pools:
  - {name: default, min_engines: 1, max_engines: 16}
scaling:
  tick_s: 5                      # how often decide() runs
  scale_down_stabilisation_s: 300
capacity:
  forecast_horizon_s: 30         # about an engine's start-up time
live:                            # only for `kvplane planner run`
  controller: 127.0.0.1:8100
  # controller_tls: {ca_file: ca.pem}  # the controller serves TLS (cert_file/key_file: mTLS)
  # engine_tls: {ca_file: ca.pem}      # the engines serve TLS (GetLoad, runtime events)
  # controller_token_file: token       # the controller runs with `auth` (its bearer token)
  # engine_token_file: token           # the engines run with `auth` and `protect_reads`
  # kubernetes: {engine_port: 9000, deployments: {default: kvplane-engine}}
```

Every knob is documented in docs/planner.md (the decision rules, the configuration). The live
mode (`kvplane planner run --config FILE`) reads this file; the offline replay (`kvplane bench
planner`) builds it from its flags, or takes one with `--config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from kvplane.config import (
    ClientTlsConfig,
    StrictFloat,
    StrictInt,
    StrictModel,
    check_ceilings,
    parse_dial_target,
    parse_host_port,
)
from planner import start_backoff
from planner.core.observations import EngineRole


class SlaTargets(StrictModel):
    ttft_ms: StrictFloat = Field(default=1000.0, gt=0)
    itl_ms: StrictFloat = Field(default=40.0, gt=0)


class PoolConfig(StrictModel):
    name: str = Field(default="default", min_length=1)
    # At least one engine: with none, requests would have nowhere to wait (the controller does
    # not buffer them), so scale-to-zero is not offered.
    min_engines: StrictInt = Field(default=1, ge=1)
    max_engines: StrictInt = Field(default=16, ge=1)
    # `kvplane engine serve` arguments this pool's local engines get after `live.engine_args`
    # (e.g. `["--role", "prefill"]`: a disaggregated fleet's prefill and decode pools).
    engine_args: tuple[str, ...] = ()
    # What the pool's engines compute (aggregated, prefill or decode), which sets the SLA
    # bounds it is sized by (docs/planner.md, "Roles"). The engines' own GetEngineInfo role
    # wins once they report one; this is the role until then (and for engines that report
    # none). None: aggregated until the engines say otherwise.
    role: EngineRole | None = None

    @model_validator(mode="after")
    def _check_bounds(self) -> PoolConfig:
        if self.max_engines < self.min_engines:
            raise ValueError(
                f"pool {self.name!r}: max_engines ({self.max_engines}) is below "
                f"min_engines ({self.min_engines})"
            )
        return self


# How long a draining engine gets to finish its requests unless `scaling.drain_deadline_s` says.
DEFAULT_DRAIN_DEADLINE_S = 300.0


class ScalingConfig(StrictModel):
    """The decision rules' timing and hysteresis (planner.core)."""

    tick_s: StrictFloat = Field(default=5.0, gt=0)  # decide() every tick_s
    # Cooldowns (seconds): after a scale-up before another one (on top of: never while
    # engines are starting); after any scaling decision before a scale-down.
    scale_up_cooldown_s: StrictFloat = Field(default=15.0, ge=0)  # after a scale-up
    scale_down_cooldown_s: StrictFloat = Field(default=60.0, ge=0)  # after any decision
    # Hysteresis: scale up when the need exceeds the engines there are; scale down only to
    # the largest size asked for over the stabilisation window (HPA's rule), computed with
    # `scale_down_headroom` extra room.
    scale_down_stabilisation_s: StrictFloat = Field(default=300.0, ge=0)  # the window
    scale_down_headroom: StrictFloat = Field(default=0.2, ge=0)  # 0.2: 20% more than the need
    # A draining engine gets this long to finish its requests before they may be aborted
    # (at most what Drain's deadline_ms, a uint32 of milliseconds, holds: 49.7 days).
    drain_deadline_s: StrictFloat = Field(
        default=DEFAULT_DRAIN_DEADLINE_S, gt=0, le=(2**32 - 1) / 1000
    )


class CapacityConfig(StrictModel):
    """The load forecast and the learned cost model (planner/core: capacity, forecast)."""

    # How far ahead the load is forecast: capacity asked for now serves after start-up.
    forecast_horizon_s: StrictFloat = Field(default=30.0, ge=0)
    # Holt's smoothing of the prompt-token arrival rate: level and trend weights per tick.
    level_alpha: StrictFloat = Field(default=0.2, gt=0, le=1)
    trend_beta: StrictFloat = Field(default=0.02, ge=0, le=1)
    # Size so that a forward pass fits this share of the ITL target, and a request's prefill
    # this share of the TTFT target (the rest is room for bursts and the model's error).
    itl_margin: StrictFloat = Field(default=0.8, gt=0, le=1)
    ttft_margin: StrictFloat = Field(default=0.5, gt=0, le=1)
    # Engines' KV caches are sized to be at most this full on average: room for requests'
    # growth, bursts and uneven spread over engines (calibrated in docs/planner.md).
    max_kv_usage: StrictFloat = Field(default=0.6, gt=0, le=1)
    # Engines compute prompts at most this share of their time while requests decode for
    # `short_output_passes` passes or fewer: a short output decodes for a few passes, and if
    # its engine computes a prompt meanwhile, those passes carry a prefill chunk (a
    # 2,048-token one is over the ITL target on its own), whatever the mean pass time. A
    # request decoding k passes averages over more of them: the share allowed grows as
    # sqrt(k / short_output_passes) (calibrated in docs/planner.md).
    max_prefill_share: StrictFloat = Field(default=0.15, gt=0, le=1)
    short_output_passes: StrictFloat = Field(default=16.0, gt=0)
    # Size for the forecast prompt-token rate plus this many of its mean absolute errors: a
    # bursty load (large errors) keeps room for its next burst, a smooth one hardly any.
    forecast_error_headroom: StrictFloat = Field(default=1.0, ge=0)
    # The cost model forgets old passes with this half-life.
    half_life_s: StrictFloat = Field(default=300.0, gt=0)
    # Priors of the cost model (pass ms = fixed + per prefill token + per KV usage), worth
    # `prior_weight` passes: the model starts there and learns the fleet's real costs.
    prior_pass_ms: StrictFloat = Field(default=15.0, ge=0)
    prior_prefill_ms_per_token: StrictFloat = Field(default=0.02, ge=0)
    prior_kv_ms: StrictFloat = Field(default=40.0, ge=0)  # per pass, at a full KV cache
    prior_weight: StrictFloat = Field(default=20.0, gt=0)


def _dial_target(value: str) -> str:
    parse_dial_target(value)  # raises ValueError: pydantic reports it against the key
    return value


def _host_port(value: str) -> str:
    parse_host_port(value)  # raises ValueError: pydantic reports it against the key
    return value


# Kubernetes names in API paths: a namespace is a DNS label, a Deployment a DNS subdomain.
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# Long enough for a loaded API server. The live planner's ticks do not wait for the calls
# (they run beside them); a start, a removal or a look at the fleet does.
API_TIMEOUT_S = 10.0


class LeaderElectionConfig(StrictModel):
    """Planners that share the Deployments elect one leader through a coordination.k8s.io/v1
    Lease (planner/leader_election.py); the others observe it and stand by. The defaults are
    client-go's (kube-controller-manager's): 15 s, 10 s, 2 s."""

    # The Lease (made by the first planner), in `namespace` (default: the Deployments').
    lease_name: str = Field(default="kvplane-planner", max_length=253, pattern=_DNS_SUBDOMAIN)
    namespace: str | None = Field(default=None, pattern=_DNS_LABEL)
    # A standby takes over a Lease not renewed for this long (a leader killed or cut off).
    lease_duration_s: StrictInt = Field(default=15, ge=1)
    # A leader that has not renewed within this of its last renewal stops acting: before a
    # standby could take over (lease_duration_s), the difference covering calls under way.
    renew_deadline_s: StrictFloat = Field(default=10.0, gt=0)
    # How often the leader renews and a standby tries to take over (jittered: up to 2.2 times).
    retry_period_s: StrictFloat = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _check_timing(self) -> LeaderElectionConfig:
        if self.renew_deadline_s >= self.lease_duration_s:
            raise ValueError(
                f"renew_deadline_s ({self.renew_deadline_s:g}) must be below lease_duration_s "
                f"({self.lease_duration_s}): a leader must stop acting before another may start"
            )
        if self.renew_deadline_s <= 1.2 * self.retry_period_s:
            raise ValueError(
                f"renew_deadline_s ({self.renew_deadline_s:g}) must be above 1.2 times "
                f"retry_period_s ({self.retry_period_s:g}): room for a renewal to be retried"
            )
        return self


class KubernetesConfig(StrictModel):
    """Engines as the pods of one Deployment per pool (planner/kubernetes.py). Unset
    `api_server` and `namespace` are those of the pod the planner runs in."""

    # https://HOST:PORT (default: from KUBERNETES_SERVICE_HOST/PORT), or http:// for a
    # `kubectl proxy`.
    api_server: str | None = Field(default=None, pattern=r"^https?://[^/\s]+/?$")
    namespace: str | None = Field(default=None, pattern=_DNS_LABEL)
    # The bearer token (followed as it changes: it is rotated) and the API server's CA; null:
    # no token (a `kubectl proxy` adds its own) / the system's trusted roots.
    token_file: Path | None = Path(f"{_SERVICE_ACCOUNT}/token")
    ca_file: Path | None = Path(f"{_SERVICE_ACCOUNT}/ca.crt")
    # The port the engine containers serve on: an engine's address is podIP:engine_port.
    engine_port: StrictInt = Field(default=9000, ge=1, le=65535)
    # The Deployment of each pool (every pool needs one; two pools cannot share one).
    deployments: dict[str, Annotated[str, Field(max_length=253, pattern=_DNS_SUBDOMAIN)]] = Field(
        min_length=1
    )
    # How often a start looks for its Ready pod.
    poll_s: StrictFloat = Field(default=1.0, gt=0)
    # Each API call ends within this (its Retry-After waits included), however slowly the
    # server answers. The ticks do not wait for the calls; a start or removal does.
    api_timeout_s: StrictFloat = Field(default=API_TIMEOUT_S, gt=0)
    # Planners sharing these Deployments elect one leader, which alone acts; null: no
    # election (one planner only, e.g. a Deployment of `replicas: 1`, `strategy: Recreate`).
    leader_election: LeaderElectionConfig | None = Field(default_factory=LeaderElectionConfig)

    @model_validator(mode="after")
    def _check_deployments(self) -> KubernetesConfig:
        names = list(self.deployments.values())
        shared = sorted({n for n in names if names.count(n) > 1})
        if shared:
            raise ValueError(f"pools share a Deployment: {', '.join(shared)}")
        return self


class LiveConfig(StrictModel):
    """What `kvplane planner run` acts on: a controller, and how to start engines (local
    processes, or with `kubernetes`, a Deployment's pods)."""

    # The controller's admin API (HOST:PORT): engines are registered there and drained
    # through it (it stops routing to them at once).
    controller: Annotated[str, AfterValidator(_dial_target)]
    # How the planner dials the controller (every admin call) and its engines (GetLoad, the
    # runtime events): {ca_file, cert_file, key_file, server_name}
    # (kvplane.config.ClientTlsConfig) for a server that serves TLS (cert_file + key_file: one
    # that requires a client certificate); None: insecure.
    controller_tls: ClientTlsConfig | None = None
    engine_tls: ClientTlsConfig | None = None
    # A file holding the bearer token of a controller / engines run with `auth`, sent on every
    # call to it / them (as the controller's own `engine_token_file`): a controller asks for
    # it on RegisterEngine, DrainEngine and RemoveEngine, and with `protect_reads` on every
    # call; engines with `protect_reads` on GetLoad and the runtime events. None: no token.
    controller_token_file: Path | None = None
    engine_token_file: Path | None = None
    # `kvplane engine serve` arguments of a new engine (the actuator adds --listen and
    # --port-file).
    engine_args: tuple[str, ...] = ("--model", "sim")
    # Engines' port files and logs (default: a temporary folder, removed at the end).
    workdir: Path | None = None
    # Set: scale Deployments instead of starting local processes.
    kubernetes: KubernetesConfig | None = None
    start_timeout_s: StrictFloat = Field(default=120.0, gt=0)
    load_timeout_s: StrictFloat = Field(default=2.0, gt=0)
    # An engine whose GetLoad failed or timed out this many ticks in a row (alive but hung)
    # is lost: taken out of the controller and killed, and the core replaces it.
    lost_after_failed_polls: StrictInt = Field(default=3, ge=1)
    # A pool whose engines fail (a start that fails; one that exits or is lost less than
    # start_backoff_crash_s after it began serving, a crash: one lost later is replaced at
    # once) retries the first failure at once, then waits start_backoff_s, doubled with each
    # failure in a row up to start_backoff_max_s; the count starts over once an engine of the
    # pool started after the last failure has served start_backoff_crash_s
    # (planner/start_backoff.py).
    start_backoff_s: StrictFloat = Field(default=start_backoff.FIRST_S, gt=0)
    start_backoff_max_s: StrictFloat = Field(default=start_backoff.MAX_S, gt=0)
    start_backoff_crash_s: StrictFloat = Field(default=start_backoff.CRASH_WITHIN_S, ge=0)
    # Prometheus /metrics on a side port (HOST:PORT); None disables it.
    metrics_listen: Annotated[str, AfterValidator(_host_port)] | None = None

    @model_validator(mode="after")
    def _check_actuator(self) -> LiveConfig:
        check_ceilings(self, ("start_backoff_s", "start_backoff_max_s"))
        local = sorted({"engine_args", "workdir"} & self.model_fields_set)
        if self.kubernetes is not None and local:
            raise ValueError(
                f"{' and '.join(local)} start local engines: with kubernetes, the engines' "
                "arguments are in the Deployment's manifest"
            )
        return self


class PlannerConfig(StrictModel):
    sla: SlaTargets = Field(default_factory=SlaTargets)
    pools: tuple[PoolConfig, ...] = (PoolConfig(),)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    # Only for the live mode (`kvplane planner run`); the offline replay ignores it.
    live: LiveConfig | None = None

    @model_validator(mode="after")
    def _check_pools(self) -> PlannerConfig:
        if not self.pools:
            raise ValueError("pools: name at least one pool")
        names = [p.name for p in self.pools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"pools listed twice: {', '.join(twice)}")
        kubernetes = self.live.kubernetes if self.live is not None else None
        if kubernetes is not None:
            missing = sorted(set(names) - set(kubernetes.deployments))
            unknown = sorted(set(kubernetes.deployments) - set(names))
            if missing:
                raise ValueError(
                    f"live.kubernetes.deployments: no Deployment for pool(s) {', '.join(missing)}"
                )
            if unknown:
                raise ValueError(f"live.kubernetes.deployments: no pool named {', '.join(unknown)}")
            local = sorted(p.name for p in self.pools if p.engine_args)
            if local:
                raise ValueError(
                    f"pools {', '.join(local)}: engine_args start local engines: with "
                    "kubernetes, the engines' arguments are in the Deployment's manifest"
                )
        return self

    def pool(self, name: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.name == name), None)
