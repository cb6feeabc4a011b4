"""The few Kubernetes API calls the planner makes, over the standard library only (the control
plane gains no dependency): a Deployment's scale subresource (GET; PATCH of spec.replicas), its
pods by label selector (LIST), a pod's annotations (merge PATCH), whether the planner may
make a call (a SelfSubjectAccessReview, which every authenticated user may create) and its
leader Lease (GET, POST, PUT: planner/leader_election.py).

Calls are blocking (`http.client`); the actuator runs each in a daemon thread of its own, which
a planner that stops does not wait for (planner/kubernetes.py, `in_daemon_thread`). Each opens
its own connection, so calls from several threads share nothing but the bearer token, whose
file is followed as every token file is (`kvplane.token_file`: a `stat` at each call, read
again when it changed): the kubelet rotates projected service-account tokens in place, and a
file caught half-written, or holding what a token cannot carry, keeps the token read before
(one warning). Every failure, an HTTP error (the API's Status object gives its reason and
message) or a server that cannot be reached, is one `KubeApiError` whose message is one line.

A call ends within `timeout_s`, retries included, however slowly the server answers (a server
that trickles its answer would otherwise hold it forever: the socket's timeout is per read);
one of a client `within` a bound ends by then too, and is not sent past it (a leader's
calls, at its renew deadline: planner/leader_election.py; the rule, planner/term_bound.py).
As client-go does, an answer that carries `Retry-After` is tried again after that long: a 429
(API Priority and Fairness refused the request unprocessed) for every verb, a 5xx for reads
only. A write that got a 5xx may have been made (a 504 Timeout: storage may commit it after
the deadline): sending it again is the caller's decision, the `KubeApiError` says it is
`unknown_outcome`. Connection failures are not retried here: the actuator tries again at its
next tick rather than hold up this one.

`in_cluster` resolves the defaults a pod has: the API server from KUBERNETES_SERVICE_HOST and
KUBERNETES_SERVICE_PORT (the environment is passed in: only the CLI reads it), the service
account's token, CA and namespace files.
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.config import join_host_port
from kvplane.errors import ConfigError, KvplaneError
from kvplane.token_file import TokenFile
from planner.config import API_TIMEOUT_S
from planner.term_bound import TimeLeft, bounded_s

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The annotation by which the ReplicaSet picks the pods a scale-down deletes (lowest first).
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"
# The body of a create (POST) or an update (PUT): the whole object.
JSON = "application/json"
# The default of `live.kubernetes.api_timeout_s` (planner.config), the limit of each call.
REQUEST_TIMEOUT_S = API_TIMEOUT_S
# A call tries this often at most (Retry-After answers; client-go allows 10, but the actuator's
# work waits).
_ATTEMPTS = 4
_READ_CHUNK_BYTES = 65536
# Where a 403, or a verb the planner's RBAC Role lacks, sends the operator.
ROLE_HINT = "the planner's RBAC Role: configs/k8s/planner-rbac.yaml"
# Pod phases after which no container runs again (restartPolicy Always included).
_ENDED_PHASES = frozenset({"Succeeded", "Failed"})


class KubeApiError(KvplaneError):
    """A call the API server refused (`status` is the HTTP code) or that did not reach it
    (`status` is None)."""

    def __init__(self, message: str, status: int | None = None, *, sent: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.sent = sent  # False: the request never reached the server (refused, TLS, DNS)

    @property
    def unknown_outcome(self) -> bool:
        """Whether a write that failed so may have been made all the same: the server took it
        and failed (5xx) or the answer was lost (a reset, a timeout)."""
        return self.sent and (self.status is None or self.status >= 500)


@dataclass(frozen=True, slots=True)
class Scale:
    """A Deployment's autoscaling/v1 Scale: its replicas, the selector of its pods (the
    Deployment's spec.selector, serialized by the API server) and the version a PATCH may
    be conditional on."""

    replicas: int
    selector: str
    resource_version: str


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    uid: str
    ip: str | None  # status.podIP, once the pod has one
    ready: bool  # status.conditions[type=Ready] is "True"
    deleting: bool  # metadata.deletionTimestamp is set: terminating
    created: str  # metadata.creationTimestamp (RFC 3339: sorts as time does)
    phase: str  # status.phase: Pending, Running, Succeeded, Failed (e.g. evicted), Unknown
    deletion_cost: str | None  # its DELETION_COST annotation, if it has one
    # Why it is not Ready, in one line ("" if it is): `_why_not_ready`.
    why_not_ready: str = ""

    @property
    def active(self) -> bool:
        """Whether the ReplicaSet counts the pod as one of its replicas (Kubernetes'
        `controller.FilterActivePods`): neither terminating nor ended. An ended pod (Failed:
        evicted, rejected by the kubelet at admission) runs no more and stays listed, without
        a deletionTimestamp, until someone deletes it; the ReplicaSet has made one in its
        place."""
        return not self.deleting and self.phase not in _ENDED_PHASES


@dataclass(frozen=True, slots=True)
class Access:
    """One verb on one resource the planner calls (a rule of its RBAC Role): `resource` with
    its `subresource` (e.g. deployments and scale), of API `group` ("" for the core group),
    optionally one object `name` (a Role may name the objects it allows), in `namespace` (""
    for the connection's)."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    name: str = ""
    namespace: str = ""

    def __str__(self) -> str:
        """As `kubectl auth can-i` takes it: `patch deployments.apps/scale kvplane-engine`."""
        resource = f"{self.resource}.{self.group}" if self.group else self.resource
        if self.subresource:
            resource += f"/{self.subresource}"
        return f"{self.verb} {resource}" + (f" {self.name}" if self.name else "")


@dataclass(frozen=True, slots=True)
class KubeConnection:
    """Where the API server is and how to authenticate to it."""

    server: str  # https://HOST:PORT, or http:// (e.g. `kubectl proxy`, which authenticates)
    namespace: str
    token_file: TokenFile | None  # None: no Authorization header
    ca_file: Path | None  # None: the system's trusted roots


def in_cluster(
    environ: Mapping[str, str],
    *,
    server: str | None,
    namespace: str | None,
    token_file: Path | None,
    ca_file: Path | None,
) -> KubeConnection:
    """The connection with each default that is not given taken from the pod the planner runs
    in; raises ConfigError (one line) when one is needed and the pod does not have it."""
    if server is None:
        host = environ.get("KUBERNETES_SERVICE_HOST")
        port = environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError(
                "live.kubernetes.api_server is not set and KUBERNETES_SERVICE_HOST is not in "
                "the environment (not in a pod): give the API server's URL"
            )
        server = f"https://{join_host_port(host, port)}"
    if namespace is None:
        namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
        try:
            namespace = namespace_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"live.kubernetes.namespace is not set and {namespace_file} cannot be read "
                f"({exc.strerror}): give the namespace"
            ) from exc
    if not server.startswith("https://"):
        ca_file = None  # plain HTTP (a `kubectl proxy`): no certificate to verify
    # Read now, to fail at start (missing, empty, not a token); followed from then on.
    token = None if token_file is None else TokenFile(token_file, "live.kubernetes.token_file")
    if ca_file is not None and not ca_file.is_file():
        raise ConfigError(f"live.kubernetes.ca_file {ca_file} is not a file")
    return KubeConnection(server.rstrip("/"), namespace, token, ca_file)


class KubeApi:
    """Blocking calls to the API server of `connection`, in its namespace."""

    def __init__(
        self,
        connection: KubeConnection,
        timeout_s: float = REQUEST_TIMEOUT_S,
        left_s: TimeLeft | None = None,
    ) -> None:
        self.connection = connection
        self.timeout_s = timeout_s
        self.left_s = left_s  # `within`'s bound
        url = urllib.parse.urlsplit(connection.server)
        if url.scheme not in {"http", "https"} or not url.hostname:
            raise ConfigError(f"live.kubernetes.api_server {connection.server!r}: not a URL")
        self._https = url.scheme == "https"
        self._netloc = url.netloc
        self._ssl: ssl.SSLContext | None = None
        if self._https:
            ca_file = connection.ca_file
            try:
                self._ssl = ssl.create_default_context(
                    cafile=str(ca_file) if ca_file is not None else None
                )
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"live.kubernetes.ca_file {ca_file}: {exc}") from exc

    def within(self, left_s: TimeLeft) -> KubeApi:
        """This client, its calls also ending within `left_s()` (seconds, read as each call
        begins), none sent or retried past that: a leader's, which must not act once its
        term may have ended (`left_s`: the time to its renew deadline)."""
        return KubeApi(self.connection, self.timeout_s, left_s)

    def get_scale(self, deployment: str) -> Scale:
        return _scale(self._call("GET", self._scale_path(deployment)))

    def patch_scale(self, deployment: str, replicas: int, resource_version: str) -> Scale:
        """Set spec.replicas if the scale is still at `resource_version`: a scale someone else
        changed since it was read is a KubeApiError with status 409 (Conflict)."""
        patch = {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}}
        return _scale(self._call("PATCH", self._scale_path(deployment), patch))

    def list_pods(self, selector: str) -> list[Pod]:
        query = urllib.parse.urlencode({"labelSelector": selector})
        listed = self._call("GET", f"/api/v1/namespaces/{self._namespace}/pods?{query}")
        return [_pod(item) for item in listed.get("items") or []]

    def annotate_pod(self, name: str, annotations: Mapping[str, str | None]) -> None:
        """Set the pod's `annotations`; one whose value is None is removed (merge patch)."""
        path = f"/api/v1/namespaces/{self._namespace}/pods/{_segment(name)}"
        self._call("PATCH", path, {"metadata": {"annotations": dict(annotations)}})

    def delete_pod(self, name: str, uid: str) -> None:
        """Delete the pod (gracefully: its termination grace period, SIGTERM first) if it is
        still the one of `uid` (a precondition: another pod since under that name is 409
        Conflict, and left alone)."""
        self._call(
            "DELETE",
            f"/api/v1/namespaces/{self._namespace}/pods/{_segment(name)}",
            {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}},
        )

    def allows(self, access: Access) -> bool:
        """Whether the API server's authorizers (RBAC) let this token make `access` in the
        namespace: a SelfSubjectAccessReview, which answers without making the call."""
        namespace = access.namespace or self.connection.namespace
        attributes = {"namespace": namespace, "verb": access.verb}
        attributes |= {"group": access.group, "resource": access.resource}
        if access.subresource:
            attributes["subresource"] = access.subresource
        if access.name:
            attributes["name"] = access.name
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        path = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
        answer = self._call("POST", path, review)
        return answer.get("status", {}).get("allowed") is True

    def get_lease(self, name: str) -> dict[str, Any]:
        """The coordination.k8s.io/v1 Lease `name` (a KubeApiError with status 404 if none)."""
        return self._call("GET", self._lease_path(name))

    def create_lease(self, name: str, spec: Mapping[str, object]) -> dict[str, Any]:
        """Create Lease `name` with `spec`: a KubeApiError with status 409 (AlreadyExists) if
        another made it first."""
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": self.connection.namespace},
            "spec": dict(spec),
        }
        return self._call("POST", self._lease_path(""), lease)

    def update_lease(self, lease: Mapping[str, Any], spec: Mapping[str, object]) -> dict[str, Any]:
        """Replace the spec of `lease` (as read) with `spec`, if the Lease is still at the
        resourceVersion read: one changed since is a KubeApiError with status 409 (Conflict)."""
        updated = {**lease, "spec": dict(spec)}
        return self._call("PUT", self._lease_path(str(lease["metadata"]["name"])), updated)

    def _lease_path(self, name: str) -> str:
        leases = f"/apis/coordination.k8s.io/v1/namespaces/{self._namespace}/leases"
        return f"{leases}/{_segment(name)}" if name else leases

    @property
    def _namespace(self) -> str:
        return _segment(self.connection.namespace)

    def _scale_path(self, deployment: str) -> str:
        deployments = f"/apis/apps/v1/namespaces/{self._namespace}/deployments"
        return f"{deployments}/{_segment(deployment)}/scale"

    def _call(self, method: str, path: str, sent: object | None = None) -> dict[str, Any]:
        """`method` on `path`, with `sent` as its JSON body (a merge patch for PATCH, the whole
        object for POST and PUT); the answer's JSON object."""
        what = f"{method} {self.connection.server}{path.split('?', maxsplit=1)[0]}"
        limit_s = bounded_s(self.timeout_s, self.left_s)
        deadline = time.monotonic() + limit_s
        body = None if sent is None else json.dumps(sent).encode()
        for attempt in range(_ATTEMPTS):
            status, retry_after_s, data = self._exchange(what, method, path, body, deadline)
            if status < 300:
                break
            error = f"{what}: {_status_line(status, data)}{self._hint(status)}"
            retried = status == 429 or (status >= 500 and method == "GET")
            if not retried or retry_after_s is None or attempt == _ATTEMPTS - 1:
                raise KubeApiError(error, status)
            if time.monotonic() + retry_after_s >= deadline:
                late = f"retry after {retry_after_s:g} s: past the call's timeout"
                raise KubeApiError(f"{error} ({late})", status)
            time.sleep(retry_after_s)  # this call's own thread: nothing else waits on it
        try:
            decoded = json.loads(data)
        except ValueError as exc:
            raise KubeApiError(f"{what}: the answer is not JSON") from exc
        if not isinstance(decoded, dict):
            raise KubeApiError(f"{what}: the answer is not a JSON object")
        return decoded

    def _exchange(
        self, what: str, method: str, path: str, body: bytes | None, deadline: float
    ) -> tuple[int, float | None, bytes]:
        """One request: its status, Retry-After (seconds) and body, read by `deadline`."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH if method == "PATCH" else JSON
        token_file = self.connection.token_file
        if token_file is not None:
            headers["Authorization"] = f"Bearer {token_file.current()}"
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:  # a socket timeout must be positive
            raise KubeApiError(f"{what}: not sent: past its deadline", sent=False)
        connection: http.client.HTTPConnection
        if self._https:
            connection = http.client.HTTPSConnection(
                self._netloc, timeout=remaining_s, context=self._ssl
            )
        else:
            connection = http.client.HTTPConnection(self._netloc, timeout=remaining_s)
        sent = False
        try:
            connection.connect()
            sent = True  # from here on, the server may have acted on it
            connection.request(method, path, body, headers)
            response = connection.getresponse()
            chunks = []
            while chunk := response.read1(_READ_CHUNK_BYTES):
                chunks.append(chunk)
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise TimeoutError(f"no whole answer within {self.timeout_s:g} s")
                assert connection.sock is not None
                connection.sock.settimeout(remaining_s)
        except (OSError, http.client.HTTPException) as exc:  # refused, TLS, timeout, reset
            raise KubeApiError(f"{what}: {_reason(exc)}", sent=sent) from exc
        finally:
            connection.close()
        return response.status, _retry_after_s(response.getheader("Retry-After")), b"".join(chunks)

    def _hint(self, status: int) -> str:
        """What to check when the API refuses the planner itself."""
        if status == 401:
            token_file = self.connection.token_file
            if token_file is None:
                return " (no token sent: give live.kubernetes.token_file)"
            return (
                f" (the token in {token_file.path} was refused; one written there is used from "
                "the next call)"
            )
        if status == 403:
            return f" ({ROLE_HINT})"
        return ""


def _retry_after_s(header: str | None) -> float | None:
    """Retry-After in seconds (the API server sends seconds; an HTTP date is not honoured)."""
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None


def _segment(name: str) -> str:
    """A name as one path segment (config validation already keeps names to DNS labels)."""
    return urllib.parse.quote(name, safe="")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: {exc.verify_message}"
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(text.split())


def _status_line(code: int, data: bytes) -> str:
    """`code Reason: message` from the API's Status object, or the code alone."""
    try:
        status = json.loads(data)
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return f"HTTP {code}"
    reason = status.get("reason") or http.client.responses.get(code, "")
    message = " ".join(str(status.get("message", "")).split())
    return f"{code} {reason}: {message}" if message else f"{code} {reason}"


def _scale(scale: dict[str, Any]) -> Scale:
    return Scale(
        int(scale.get("spec", {}).get("replicas", 0)),
        str(scale.get("status", {}).get("selector", "")),
        str(scale.get("metadata", {}).get("resourceVersion", "")),
    )


def _pod(pod: dict[str, Any]) -> Pod:
    metadata, status = pod.get("metadata", {}), pod.get("status", {})
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    phase = str(status.get("phase", ""))
    return Pod(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        ip=status.get("podIP") or None,
        ready=ready,
        deleting=metadata.get("deletionTimestamp") is not None,
        created=str(metadata.get("creationTimestamp", "")),
        phase=phase,
        deletion_cost=(metadata.get("annotations") or {}).get(DELETION_COST),
        why_not_ready="" if ready else _why_not_ready(phase, status),
    )


def _why_not_ready(phase: str, status: dict[str, Any]) -> str:
    """What keeps a pod from Ready, as `kubectl describe pod` would show it: the scheduler's
    condition of a pod no node has room for (`Pending, Unschedulable: 0/4 nodes are
    available: 4 Insufficient nvidia.com/gpu.`), else a container's waiting reason
    (CrashLoopBackOff, ImagePullBackOff, ContainerCreating) and its message, else the phase;
    with the containers' restarts, if any."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            why = f"{phase}, {condition.get('reason') or 'not scheduled'}"
            message = " ".join(str(condition.get("message") or "").split())
            return f"{why}: {message}" if message else why
    containers = status.get("containerStatuses") or []
    restarts = sum(int(c.get("restartCount") or 0) for c in containers)
    why = f"{phase}, not Ready"
    for container in containers:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            why = str(waiting["reason"])
            message = " ".join(str(waiting.get("message") or "").split())
            why += f": {message}" if message else ""
            break
    if restarts:
        why += f" ({restarts} restart{'s' if restarts > 1 else ''})"
    return why
