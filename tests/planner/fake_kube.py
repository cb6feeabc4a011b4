"""A fake Kubernetes API server for the planner's Kubernetes actuator: the real paths and JSON
shapes of the calls it makes, over a ReplicaSet-like controller and a kubelet-like part that
runs each pod as a real `kvplane engine serve` process.

What it implements (namespaced, one namespace):

- `GET` and `PATCH .../apis/apps/v1/namespaces/NS/deployments/NAME/scale`: an autoscaling/v1
  Scale (spec.replicas; status.replicas and status.selector, the Deployment's matchLabels
  serialized as the API server does). PATCH takes `application/merge-patch+json` or
  `application/strategic-merge-patch+json` (the same for a Scale); other content types are
  415. A `metadata.resourceVersion` in the patch that is not the current one is 409 Conflict.
- `GET .../api/v1/namespaces/NS/pods?labelSelector=k=v,...` (equality selectors only): a
  PodList; `GET`, `PATCH` (merge patch: labels and annotations) and `DELETE` of
  `.../pods/NAME` (DeleteOptions' `preconditions.uid` another pod's: 409 Conflict).
- `POST .../apis/authorization.k8s.io/v1/selfsubjectaccessreviews` (any authenticated user
  may, as the `system:basic-user` ClusterRole allows): 201 and the review with its
  status.allowed as the fake's RBAC decides (reason named as RBAC does when allowed), for
  resourceAttributes in the fake's namespace; exactly one of resourceAttributes and
  nonResourceAttributes, else 422 (non-resource URLs are never allowed here).
- The fake's RBAC, the planner's Role: with `allowed` None (the default) every (API group,
  resource, verb) is granted, else only those it holds (resource as a Role names it:
  `deployments/scale`); `forbidden` refuses a (verb, resource) on top. A request RBAC does
  not grant is 403 Forbidden with the API server's message, and so reviewed.
- `GET`, `PUT` of `.../apis/coordination.k8s.io/v1/namespaces/NS/leases/NAME` and `POST`
  of `.../leases` (coordination.k8s.io/v1 Lease): a create of a name that exists is 409
  AlreadyExists, an update of one that does not 404, an update whose metadata.resourceVersion
  is not the current one 409 Conflict (none: unconditional), a name not the URL's 400; the
  spec's leaseDurationSeconds must be > 0 and leaseTransitions >= 0 (422), acquireTime and
  renewTime RFC 3339 times (400). POST and PUT take `application/json` (else 415).
- Clients are told apart by their bearer token: `token`, or one of `other_tokens` (e.g. a
  second planner's). `writes` records every request that is not a read (any method but GET;
  access reviews aside, which persist nothing) with the token that sent it, answered or not.
- Errors are Status objects (`kind: Status`, `code`, `reason`, `message`): 401 without a
  bearer token it knows, 403 for what the RBAC part does not grant (the RBAC message), 404
  for a missing object or path, 405, 409, 415, 422 for replicas that are not a natural number.
  Every change bumps a cluster-wide resourceVersion, the Deployment's too when the
  Deployment controller part writes its status (after each change of spec.replicas, of its
  pods' count or readiness), as Kubernetes' does: a scale read before is stale then.
- The ReplicaSet part keeps as many non-terminating pods as replicas. Scaling down, it deletes
  pods in Kubernetes' order (`ActivePodsWithRanks`): Pending before Running, not Ready before
  Ready, lower `controller.kubernetes.io/pod-deletion-cost` first, then the more recently
  Ready, then the newer. `stale_deletion_cost` makes the next scale-down ignore the costs, as
  a ReplicaSet controller whose cache has not seen an annotation yet does. `hold_replicasets`
  makes it act on nothing until cleared, then on the latest spec.replicas only, as
  Kubernetes' Deployment and ReplicaSet controllers do when several changes arrive before
  their work queue syncs (a scale from 1 to 0 and back to 1 deletes no pod).
- `faults` (a list of `Fault`, of a method and a resource: "deployments/scale", "pods",
  "leases") answers the next matching requests as an overloaded or failing
  API server does: 429 TooManyRequests (API Priority and Fairness: the request was not
  processed, `Retry-After` header and `details.retryAfterSeconds`), 500 InternalError, 503
  ServiceUnavailable (a restarting server: with `Retry-After` when given), 504 Timeout (the
  server gave up waiting for storage; with `applied`, the write was made all the same, as
  etcd may commit it after the deadline).
- `go_down` and `come_back`: the API server stops listening (connections refused) while
  the cluster runs on, then listens again at the same address.
- `hang_requests` makes the server a hung one: each request gets a 200's headers, then its
  body one byte at a time without end, so every read of the client's gets a byte before its
  timeout and the call never ends on its own. `hung_requests` counts the requests taken,
  `dropped_requests` those whose client hung up. `hang_deployments` does so for the requests
  of those Deployments only (their scale, their pods listed or by name), as a server whose
  storage is slow for some objects: the others are answered.
- `delay_s` makes a slow API server: every answer comes that long after its request.
- `pod_listings` counts the pod LISTs answered.
- `unschedulable` leaves the pods made meanwhile Pending, unscheduled (PodScheduled False,
  reason Unschedulable: no node has room), until it is cleared.
- An answer over 2048 bytes is sent chunked (`Transfer-Encoding: chunked`), as the API
  server's are (Go's net/http, no Content-Length); a shorter one with its Content-Length.
- The kubelet part gives pod n the IP 127.A.B.C (A random per server, so concurrent test runs do
  not collide; Linux routes all of 127.0.0.0/8 to lo), or with `ipv6` the IP ::1 (an IPv6 cluster's;
  one pod at a time then: loopback has one IPv6 address), given when its sandbox is made (`reuse_ip`
  hands a gone pod's IP to the next, as a cluster's IPAM recycles them), starts `python -m kvplane
  engine serve ENGINE_ARGS --listen IP:PORT` (one container port for every pod, as in a cluster; an
  IPv6 IP in brackets), and marks it Ready once the gRPC health check answers SERVING (a readiness
  probe, configs/k8s/engine-deployment.yaml's: the empty service name, which an engine answers
  SERVING while its process runs, drained or not). A Ready pod is
  probed again every `readiness_period_s` (the manifest's periodSeconds, 2 s), and is not
  Ready once READINESS_FAILURE_THRESHOLD probes in a row fail (the kubelet's default, 3: a
  hung container, SIGSTOPped), Ready again at the next that succeeds; `probes` counts each
  pod's probes. A container that exits leaves its pod not Ready and is
  restarted after `restart_delay_s` (as with CrashLoopBackOff, the container's waiting reason
  meanwhile, its restartCount one more at each restart; `restart_container` ends the wait);
  the pod stays Running at its IP meanwhile (a container not started yet is waiting
  ContainerCreating). A deleted pod gets a
  deletionTimestamp, its process SIGTERM, and leaves the list once the process has exited
  (SIGKILL after the grace period). `evict` fails a pod as the kubelet's eviction does: its
  container killed, phase Failed (reason Evicted), still listed with its IP and without a
  deletionTimestamp; the ReplicaSet part, like Kubernetes', counts only pods neither
  terminating nor failed, and makes one in its place.

Not implemented: watches, field selectors, set-based label selectors, JSON patch, server-side
apply, Deployment rollouts (one ReplicaSet per Deployment), scheduling, node placement, and
liveness probes (a hung container is not Ready after its readiness probe's failures, but not
restarted).
"""

from __future__ import annotations

import http.server
import itertools
import json
import os
import random
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.config import join_host_port
from kvplane.up.member import member_environment

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_PATCH_TYPES = {"application/merge-patch+json", "application/strategic-merge-patch+json"}
_OBJECT_TYPES = {"application/json"}  # a create's or an update's body (yaml, protobuf: unused)
# The API server's time formats (metav1.Time, metav1.MicroTime): RFC 3339.
_RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
_LOOP_S = 0.05  # the controllers' and kubelet's pass
_TERMINATION_GRACE_S = 30.0
# Readiness probe failures in a row after which a Ready pod is not Ready (the kubelet's default
# failureThreshold; configs/k8s/engine-deployment.yaml sets none).
READINESS_FAILURE_THRESHOLD = 3
# The API server sets no Content-Length: Go's net/http sends an answer longer than its
# handler's 2048-byte buffer chunked (a pod list of more than a pod or two, in a cluster), in
# chunks of its 4096-byte writer.
_GO_UNCHUNKED_BYTES = 2048
_GO_CHUNK_BYTES = 4096
_IMAGE = "ghcr.io/kvplane/kvplane:latest"
T = TypeVar("T")


@dataclass
class Deployment:
    name: str
    uid: str
    labels: dict[str, str]
    replicas: int
    resource_version: str
    created: str
    # Its status as last written by the Deployment controller: (observed spec.replicas,
    # status.replicas, status.readyReplicas).
    status: tuple[int, int, int] = (0, 0, 0)


@dataclass
class Pod:
    name: str
    uid: str
    deployment: str
    labels: dict[str, str]
    ip: str
    created: str
    number: int
    resource_version: str
    annotations: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    ready_since: float | None = None  # monotonic; None: not Ready
    probed_at: float = 0.0  # monotonic: its last readiness probe's start
    probe_failures: int = 0  # readiness probes failed in a row since it was Ready
    probes: int = 0  # readiness probes made
    # Its container was started once: the pod is Running, at its IP, from then on, a crashed
    # container waiting to be restarted (CrashLoopBackOff) included.
    sandboxed: bool = False
    restart_at: float | None = None  # a container that exited starts again then
    restarts: int = 0  # its container's (restartCount)
    deleting_since: float | None = None  # monotonic; set: terminating
    deletion_timestamp: str | None = None
    scheduled: bool = False  # bound to a node (`unschedulable` keeps new pods from it)
    # Set ("Evicted"): the pod failed (status.phase Failed) and stays listed, its container
    # stopped for good; the ReplicaSet no longer counts it.
    failed_reason: str | None = None

    @property
    def active(self) -> bool:
        """Whether the ReplicaSet counts the pod (Kubernetes' `controller.FilterActivePods`):
        neither terminating nor failed."""
        return self.deletion_timestamp is None and self.failed_reason is None

    @property
    def ready(self) -> bool:
        return self.ready_since is not None


class ApiError(Exception):
    def __init__(
        self, code: int, reason: str, message: str, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.retry_after_s = retry_after_s


# The reason and message the API server gives with each code a `Fault` may answer.
_FAULT_STATUS = {
    429: ("TooManyRequests", "Too many requests, please try again later."),
    500: ("InternalError", "Internal error occurred: etcdserver: leader changed"),
    503: ("ServiceUnavailable", "The server is currently unable to handle the request"),
    504: (
        "Timeout",
        "Timeout: request did not complete within requested timeout - context deadline exceeded",
    ),
}


@dataclass
class Fault:
    """The next `times` requests of `method` on `resource` ("deployments/scale", "pods",
    "leases") answered with `code` (one of `_FAULT_STATUS`)."""

    method: str
    resource: str
    code: int
    times: int = 1
    retry_after_s: int | None = None
    applied: bool = False  # a write made before the error is answered


class FakeKube:
    def __init__(
        self,
        workdir: Path,
        *,
        engine_port: int,
        namespace: str = "serving",
        token: str = "planner-token",
        tls: tuple[Path, Path] | None = None,
        engine_args: Sequence[str] = ("--model", "sim"),
        restart_delay_s: float = 1.0,
        readiness_period_s: float = 2.0,
        ipv6: bool = False,
    ) -> None:
        self.namespace, self.token, self.engine_port = namespace, token, engine_port
        self._workdir, self._engine_args = workdir, tuple(engine_args)
        self._restart_delay_s = restart_delay_s
        self._readiness_period_s = readiness_period_s
        self._ipv6 = ipv6
        self._versions = itertools.count(1000)
        self._numbers = itertools.count()
        self._subnet = random.randrange(64, 255)
        self._changed = threading.Condition()
        self.deployments: dict[str, Deployment] = {}
        self.pods: dict[str, Pod] = {}
        self.deleted: list[str] = []  # pods the ReplicaSet part deleted to scale down, in order
        # The RBAC part: (API group, resource, verb) granted (None: all), and (verb, resource)
        # refused on top.
        self.allowed: set[tuple[str, str, str]] | None = None
        self.forbidden: set[tuple[str, str]] = set()  # (verb, resource) refused with 403
        self.leases: dict[str, dict[str, Any]] = {}  # coordination.k8s.io/v1 Leases by name
        self.reviews: list[dict[str, Any]] = []  # the SelfSubjectAccessReviews' attributes
        self.requests: set[tuple[str, str, str]] = set()  # (API group, resource, verb) asked
        self.other_tokens: set[str] = set()  # bearer tokens accepted beside `token`
        self.writes: list[tuple[str, str, str]] = []  # (token, method, path), in order
        # Set: the next scale-down ranks pods without their deletion cost, as a ReplicaSet
        # controller does whose informer cache has not seen the annotation yet.
        self.stale_deletion_cost = False
        # Set: the ReplicaSet part waits; cleared, it sees only the latest replicas.
        self.hold_replicasets = False
        # Set: every request hangs (see the module's docstring); or those of these Deployments.
        self.hang_requests = False
        self.hang_deployments: set[str] = set()
        self.delay_s = 0.0  # every answer this late (a slow API server)
        # Set: new pods stay Pending, unscheduled (no node has a free GPU); cleared, they run.
        self.unschedulable = False
        self.faults: list[Fault] = []
        self.pod_listings = 0  # pod LISTs answered
        self._reused_ips: list[str] = []  # given to the next pods sandboxed (`reuse_ip`)
        self.faulted = 0  # requests answered with a fault
        self.hung_requests = 0
        self.dropped_requests = 0
        self._closing = threading.Event()
        self._tls = tls
        self._server = self._listen(0)
        scheme = "http" if tls is None else "https"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self._threads = [
            threading.Thread(target=self._server.serve_forever, name="fake-kube-api"),
            threading.Thread(target=self._run_controllers, name="fake-kube-kubelet"),
        ]
        for thread in self._threads:
            thread.start()

    def _listen(self, port: int) -> http.server.ThreadingHTTPServer:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        server.daemon_threads = True
        if self._tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*self._tls)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        return server

    # ---------------------------------------------------------------- for tests

    def go_down(self) -> None:
        """The API server stops listening (restarted, or its node lost): connections are
        refused; the cluster (ReplicaSet, kubelet, pods) runs on."""
        self._server.shutdown()
        self._server.server_close()

    def come_back(self) -> None:
        """The API server listens again, at the same address."""
        self._server = self._listen(self._server.server_address[1])
        thread = threading.Thread(target=self._server.serve_forever, name="fake-kube-api")
        self._threads.append(thread)
        thread.start()

    def add_deployment(self, name: str, replicas: int, labels: dict[str, str]) -> None:
        with self._changed:
            self.deployments[name] = Deployment(
                name, str(uuid.uuid4()), labels, replicas, self._version(), _now()
            )
            self._changed.notify_all()

    def delete_deployment(self, name: str) -> None:
        """`kubectl delete deployment NAME` (background propagation): the Deployment is gone
        at once, and the garbage collector deletes its pods (through its ReplicaSet)."""
        with self._changed:
            del self.deployments[name]
            for pod in self.pods.values():
                if pod.deployment == name and pod.deletion_timestamp is None:
                    self._delete(pod)
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Until `predicate()` (called under the lock) holds; TimeoutError after `timeout_s`."""
        with self._changed:
            if not self._changed.wait_for(predicate, timeout_s):
                raise TimeoutError("the fake cluster did not get there")

    def view(self, read: Callable[[], T]) -> T:
        """`read()` under the lock: the kubelet and ReplicaSet thread changes the pods."""
        with self._changed:
            return read()

    def ready_pods(self, deployment: str) -> list[Pod]:
        with self._changed:  # the kubelet thread changes the dict (the lock is re-entrant)
            return sorted(
                (
                    p
                    for p in self.pods.values()
                    if p.deployment == deployment and p.ready and p.deletion_timestamp is None
                ),
                key=lambda p: p.number,
            )

    def address(self, pod: Pod) -> str:
        return join_host_port(pod.ip, self.engine_port)

    def evict(self, name: str) -> None:
        """The kubelet evicts the pod (node pressure; a GPU pod the kubelet rejects at
        admission ends so too): its container is killed, the pod's phase is Failed (reason
        Evicted), it stays listed without a deletionTimestamp until someone deletes it (the
        pod garbage collector only does past thousands of such pods), and the ReplicaSet,
        which no longer counts it, makes a pod in its place."""
        with self._changed:
            pod = self.pods[name]
            process, pod.process = pod.process, None
            pod.failed_reason = "Evicted"
            pod.ready_since = pod.restart_at = None
            pod.resource_version = self._version()
            self._changed.notify_all()
        if process is not None:
            process.kill()
            process.wait()

    def reuse_ip(self, ip: str) -> None:
        """The IPAM gives `ip`, a gone pod's (no pod listed holds it), to the next pod whose
        sandbox is made, as a cluster's pod CIDR recycles the IPs of pods gone."""
        with self._changed:
            assert all(pod.ip != ip for pod in self.pods.values()), f"{ip} is held"
            self._reused_ips.append(ip)

    def kill_container(self, name: str) -> None:
        """SIGKILL a pod's engine, as a crash (the pod stays, not Ready)."""
        with self._changed:
            process = self.pods[name].process
        assert process is not None
        process.kill()
        process.wait()

    def restart_container(self, name: str) -> None:
        """End the restart back-off of a pod's crashed container, once the pod is seen not
        Ready: it starts again at the next pass, in the same pod at the same IP (and is Ready
        once its health answers)."""
        with self._changed:
            pod = self.pods[name]
            assert pod.restart_at is not None, "the crash is not seen yet"
            pod.restart_at = time.monotonic()

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        for thread in self._threads:
            thread.join()
        for pod in self.pods.values():
            _stop(pod.process)

    # ---------------------------------------------------------------- the API

    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, object]:
        scheme, _, token = str(headers.get("Authorization") or "").partition(" ")
        if scheme != "Bearer" or token not in {self.token, *self.other_tokens}:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        url = urllib.parse.urlsplit(path)
        parts = url.path.strip("/").split("/")
        if method != "GET" and parts[-1:] != ["selfsubjectaccessreviews"]:
            with self._changed:
                self.writes.append((token, method, url.path))
        fault = self._fault(method, _fault_resource(parts))
        if fault is not None:
            if fault.applied:
                self._route(method, url, parts, headers, body)
            reason, message = _FAULT_STATUS[fault.code]
            raise ApiError(fault.code, reason, message, fault.retry_after_s)
        return self._route(method, url, parts, headers, body)

    def _fault(self, method: str, resource: str) -> Fault | None:
        with self._changed:
            for fault in self.faults:
                if fault.method == method and fault.resource == resource:
                    fault.times -= 1
                    if fault.times == 0:
                        self.faults.remove(fault)
                    self.faulted += 1
                    self._changed.notify_all()
                    return fault
        return None

    def _route(
        self,
        method: str,
        url: urllib.parse.SplitResult,
        parts: list[str],
        headers: Any,
        body: bytes,
    ) -> tuple[int, object]:
        namespaced = f"namespaces/{self.namespace}"
        if parts == ["apis", "authorization.k8s.io", "v1", "selfsubjectaccessreviews"]:
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", f"the server does not allow {method} here")
            return self._review(headers, body)
        if parts[:6] == ["apis", "coordination.k8s.io", "v1", *namespaced.split("/"), "leases"]:
            if len(parts) == 6 and method == "POST":
                return self._create_lease(headers, body)
            if len(parts) == 7 and method in {"GET", "PUT"}:
                return self._lease(method, parts[6], headers, body)
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow {method} here")
        if parts[:5] == ["apis", "apps", "v1", *namespaced.split("/")]:
            if len(parts) == 8 and parts[5] == "deployments" and parts[7] == "scale":
                return self._scale(method, parts[6], headers, body)
        elif parts[:4] == ["api", "v1", *namespaced.split("/")] and parts[4:5] == ["pods"]:
            if len(parts) == 5 and method == "GET":
                self._check_allowed("list", "pods", "")
                query = urllib.parse.parse_qs(url.query)
                listed = self._pod_list(query.get("labelSelector", [""])[0])
                with self._changed:
                    self.pod_listings += 1
                    self._changed.notify_all()
                return 200, listed
            if len(parts) == 6:
                return self._pod(method, parts[5], headers, body)
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    def _scale(self, method: str, name: str, headers: Any, body: bytes) -> tuple[int, object]:
        verb = {"GET": "get", "PATCH": "patch"}.get(method)
        if verb is None:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow {method} here")
        self._check_allowed(verb, "deployments/scale", f'deployments.apps "{name}"', "apps")
        with self._changed:
            deployment = self.deployments.get(name)
            if deployment is None:
                raise ApiError(404, "NotFound", f'deployments.apps "{name}" not found')
            if method == "PATCH":
                patch = _merge_patch(headers, body)
                version = patch.get("metadata", {}).get("resourceVersion")
                if version and version != deployment.resource_version:  # "": unconditional
                    raise ApiError(
                        409,
                        "Conflict",
                        f'Operation cannot be fulfilled on deployments.apps "{name}": the '
                        "object has been modified; please apply your changes to the latest "
                        "version and try again",
                    )
                replicas = patch.get("spec", {}).get("replicas", deployment.replicas)
                if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                    raise ApiError(
                        422, "Invalid", f'Scale.autoscaling "{name}" is invalid: spec.replicas'
                    )
                deployment.replicas = replicas
                deployment.resource_version = self._version()
                self._changed.notify_all()
            return 200, self._scale_object(deployment)

    def _pod(self, method: str, name: str, headers: Any, body: bytes) -> tuple[int, object]:
        verb = {"GET": "get", "PATCH": "patch", "DELETE": "delete"}.get(method)
        if verb is None:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow {method} here")
        self._check_allowed(verb, "pods", f'pods "{name}"')
        with self._changed:
            pod = self.pods.get(name)
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found')
            if method == "PATCH":
                metadata = _merge_patch(headers, body).get("metadata", {})
                for key, target in (("annotations", pod.annotations), ("labels", pod.labels)):
                    for item, value in (metadata.get(key) or {}).items():
                        if value is None:
                            target.pop(item, None)
                        else:
                            target[item] = str(value)
                pod.resource_version = self._version()
            elif method == "DELETE":
                options = _json_body(headers, body, _OBJECT_TYPES, "body") if body else {}
                uid = (options.get("preconditions") or {}).get("uid")
                if uid is not None and uid != pod.uid:
                    raise ApiError(
                        409,
                        "Conflict",
                        f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                        f"{pod.uid}",
                    )
                if pod.deletion_timestamp is None:  # else: under way, 200
                    self._delete(pod)
            self._changed.notify_all()
            return 200, self._pod_object(pod)

    def grants(self, group: str, resource: str, verb: str) -> bool:
        """Whether the fake's RBAC lets the planner's service account make the call."""
        allowed = self.allowed is None or (group, resource, verb) in self.allowed
        return allowed and (verb, resource) not in self.forbidden

    def _check_allowed(self, verb: str, resource: str, what: str, group: str = "") -> None:
        self.requests.add((group, resource, verb))
        if not self.grants(group, resource, verb):
            raise ApiError(
                403,
                "Forbidden",
                f"{what or resource} is forbidden: User "
                f'"system:serviceaccount:{self.namespace}:kvplane-planner" cannot {verb} '
                f'resource "{resource}" in API group "{group}" in the namespace '
                f'"{self.namespace}"',
            )

    def _review(self, headers: Any, body: bytes) -> tuple[int, object]:
        """A SelfSubjectAccessReview: what the RBAC part decides for the attributes asked."""
        review = _object(headers, body, "authorization.k8s.io/v1", "SelfSubjectAccessReview")
        spec = review.get("spec") or {}
        attributes = spec.get("resourceAttributes")
        if (attributes is None) == (spec.get("nonResourceAttributes") is None):
            raise ApiError(
                422,
                "Invalid",
                "SelfSubjectAccessReview.authorization.k8s.io is invalid: spec.resourceAttributes: "
                'Invalid value: "null": exactly one of nonResourceAttributes or '
                "resourceAttributes must be specified",
            )
        allowed = False
        if attributes is not None:
            with self._changed:
                self.reviews.append(dict(attributes))
            resource = str(attributes.get("resource", ""))
            if attributes.get("subresource"):
                resource += f"/{attributes['subresource']}"
            allowed = attributes.get("namespace") == self.namespace and self.grants(
                str(attributes.get("group", "")), resource, str(attributes.get("verb", ""))
            )
        status: dict[str, Any] = {"allowed": allowed}
        if allowed:
            status["reason"] = (
                f'RBAC: allowed by RoleBinding "kvplane-planner/{self.namespace}" of Role '
                f'"kvplane-planner" to ServiceAccount "kvplane-planner/{self.namespace}"'
            )
        answer = {
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }
        return 201, answer

    def _create_lease(self, headers: Any, body: bytes) -> tuple[int, object]:
        lease = _object(headers, body, "coordination.k8s.io/v1", "Lease")
        metadata = lease.get("metadata") or {}
        name = metadata.get("name")
        # A create's URL names no object: RBAC's message names the resource alone.
        self._check_allowed("create", "leases", "leases.coordination.k8s.io", "coordination.k8s.io")
        what = f'leases.coordination.k8s.io "{name}"'
        if not name:
            raise ApiError(
                422,
                "Invalid",
                "Lease.coordination.k8s.io is invalid: metadata.name: Required value",
            )
        self._check_namespace(metadata)
        spec = _lease_spec(lease, name)
        with self._changed:
            if name in self.leases:
                raise ApiError(409, "AlreadyExists", f"{what} already exists")
            self.leases[name] = {
                "kind": "Lease",
                "apiVersion": "coordination.k8s.io/v1",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "uid": str(uuid.uuid4()),
                    "resourceVersion": self._version(),
                    "creationTimestamp": _now(),
                },
                "spec": spec,
            }
            self._changed.notify_all()
            return 201, self.leases[name]

    def _lease(self, method: str, name: str, headers: Any, body: bytes) -> tuple[int, object]:
        what = f'leases.coordination.k8s.io "{name}"'
        verb = {"GET": "get", "PUT": "update"}[method]
        self._check_allowed(verb, "leases", what, "coordination.k8s.io")
        update = (
            _object(headers, body, "coordination.k8s.io/v1", "Lease") if verb == "update" else None
        )
        with self._changed:
            lease = self.leases.get(name)
            if lease is None:
                raise ApiError(404, "NotFound", f"{what} not found")
            if update is not None:
                metadata = update.get("metadata") or {}
                if metadata.get("name") != name:
                    raise ApiError(
                        400,
                        "BadRequest",
                        f"the name of the object ({metadata.get('name')}) does not match the "
                        f"name on the URL ({name})",
                    )
                self._check_namespace(metadata)
                version = metadata.get("resourceVersion")
                if version and version != lease["metadata"]["resourceVersion"]:
                    raise ApiError(
                        409,
                        "Conflict",
                        f"Operation cannot be fulfilled on {what}: the object has been "
                        "modified; please apply your changes to the latest version and try again",
                    )
                lease["spec"] = _lease_spec(update, name)
                lease["metadata"]["resourceVersion"] = self._version()
                self._changed.notify_all()
            return 200, json.loads(json.dumps(lease))  # a copy: the answer is sent unlocked

    def _check_namespace(self, metadata: dict[str, Any]) -> None:
        namespace = metadata.get("namespace")
        if namespace and namespace != self.namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on "
                "the request",
            )

    def _scale_object(self, deployment: Deployment) -> dict[str, Any]:
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": deployment.name,
                "namespace": self.namespace,
                "uid": deployment.uid,
                "resourceVersion": deployment.resource_version,
                "creationTimestamp": deployment.created,
            },
            # autoscaling/v1 ScaleSpec's replicas is `omitempty`: a Deployment at 0 has `{}`.
            "spec": {"replicas": deployment.replicas} if deployment.replicas else {},
            "status": {
                "replicas": deployment.status[1],  # as the Deployment's status last said
                "selector": ",".join(f"{k}={v}" for k, v in sorted(deployment.labels.items())),
            },
        }

    def _pod_list(self, selector: str) -> dict[str, Any]:
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        with self._changed:
            items = [
                self._pod_object(p)
                for p in sorted(self.pods.values(), key=lambda p: p.name)
                if all(p.labels.get(k) == v for k, v in wanted.items())
            ]
            version = str(next(self._versions))
        return {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": version},
            "items": items,
        }

    def _pod_object(self, pod: Pod) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": pod.name,
            "namespace": self.namespace,
            "uid": pod.uid,
            "resourceVersion": pod.resource_version,
            "creationTimestamp": pod.created,
            "labels": dict(pod.labels),
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{pod.deployment}-rs"}
            ],
        }
        if pod.annotations:
            metadata["annotations"] = dict(pod.annotations)
        if pod.deletion_timestamp is not None:
            metadata["deletionTimestamp"] = pod.deletion_timestamp
        started = pod.process is not None
        status: dict[str, Any]
        if pod.failed_reason is not None:  # the IP it had stays in its status
            status = {"phase": "Failed", "reason": pod.failed_reason, "podIP": pod.ip}
        else:
            sandboxed = pod.sandboxed
            status = {"phase": "Running" if sandboxed else "Pending"}
            status.update({"podIP": pod.ip, "podIPs": [{"ip": pod.ip}]} if sandboxed else {})
        # The conditions a kubelet reports, in its order: the planner reads only Ready.
        conditions = {
            "PodReadyToStartContainers": True,
            "Initialized": True,
            "Ready": pod.ready,
            "ContainersReady": pod.ready,
            "PodScheduled": True,
        }
        state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        if started:
            state = {"running": {"startedAt": pod.created}}
        elif pod.sandboxed:
            back_off = f"back-off {self._restart_delay_s:g}s restarting failed container=engine"
            state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"{back_off} pod={pod.name}_{self.namespace}({pod.uid})",
                }
            }
        scheduled = {"nodeName": "node-1"} if pod.scheduled else {}
        pod_object = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": metadata,
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "image": _IMAGE,
                        "ports": [{"containerPort": self.engine_port, "protocol": "TCP"}],
                        "readinessProbe": {"grpc": {"port": self.engine_port}},
                    }
                ],
                "restartPolicy": "Always",
                "terminationGracePeriodSeconds": int(_TERMINATION_GRACE_S),
                **scheduled,
                "serviceAccountName": "default",
            },
            "status": {
                **status,
                "hostIP": "10.0.0.1",
                "qosClass": "BestEffort",
                "startTime": pod.created,
                "conditions": [
                    {"type": kind, "status": str(value), "lastTransitionTime": pod.created}
                    for kind, value in conditions.items()
                ],
                "containerStatuses": [
                    {
                        "name": "engine",
                        "image": _IMAGE,
                        "ready": pod.ready,
                        "started": started,
                        "restartCount": pod.restarts,
                        "state": state,
                    }
                ],
            },
        }
        if not pod.scheduled:  # as the scheduler leaves a pod no node has room for
            unschedulable = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
            }
            pod_object["status"] = {"phase": "Pending", "conditions": [unschedulable]}
        return pod_object

    def hang(self, write: Callable[[bytes], object]) -> None:
        """Answer a hung request's body a byte a pass until the client hangs up (or the
        server closes)."""
        with self._changed:
            self.hung_requests += 1
            self._changed.notify_all()
        try:
            while not self._closing.wait(_LOOP_S):
                write(b" ")
        except OSError:  # the client went away: broken pipe, reset
            with self._changed:
                self.dropped_requests += 1
                self._changed.notify_all()

    def hangs(self, path: str) -> bool:
        """Whether the request for `path` is to hang: `hang_requests`, or it names (its scale,
        its pods' selector, one of its pods) a Deployment of `hang_deployments`."""
        if self.hang_requests:
            return True
        if not self.hang_deployments:
            return False
        url = urllib.parse.urlsplit(path)
        parts = url.path.strip("/").split("/")
        with self._changed:
            if parts[-1] == "scale":
                return parts[-2] in self.hang_deployments
            if parts[-1] == "pods":
                selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
                wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
                return any(
                    self.deployments[name].labels == wanted
                    for name in self.hang_deployments
                    if name in self.deployments
                )
            pod = self.pods.get(parts[-1])
            return pod is not None and pod.deployment in self.hang_deployments

    def _version(self) -> str:
        return str(next(self._versions))

    # ---------------------------------------------------------------- ReplicaSet and kubelet

    def _run_controllers(self) -> None:
        while not self._closing.wait(_LOOP_S):
            with self._changed:
                for deployment in self.deployments.values():
                    if not self.hold_replicasets:
                        self._replicate(deployment)
                        self._write_status(deployment)
                for pod in list(self.pods.values()):
                    self._run(pod)
                self._changed.notify_all()
                due = [p for p in self.pods.values() if self._probe_due(p)]
                for pod in due:
                    pod.probed_at = time.monotonic()
            # Probes outside the lock: a health check may take up to its timeout.
            for pod in due:
                healthy = _healthy(self.address(pod))
                with self._changed:
                    pod.probes += 1
                    if pod.process is None or pod.deletion_timestamp is not None:
                        continue  # exited or deleted meanwhile: not probed any more
                    if healthy:
                        pod.probe_failures = 0
                        if not pod.ready:
                            pod.ready_since = time.monotonic()
                            pod.resource_version = self._version()
                    elif pod.ready:
                        pod.probe_failures += 1
                        if pod.probe_failures >= READINESS_FAILURE_THRESHOLD:
                            pod.ready_since = None
                            pod.resource_version = self._version()
                    self._changed.notify_all()

    def _probe_due(self, pod: Pod) -> bool:
        """A started container's readiness probe: at every pass until it is Ready (a start is
        not held up by the period), then every `readiness_period_s`."""
        if pod.process is None or pod.deletion_timestamp is not None or pod.failed_reason:
            return False
        return not pod.ready or time.monotonic() - pod.probed_at >= self._readiness_period_s

    def _replicate(self, deployment: Deployment) -> None:
        active = [p for p in self.pods.values() if p.deployment == deployment.name and p.active]
        for _ in range(deployment.replicas - len(active)):
            number = next(self._numbers)
            name = f"{deployment.name}-{uuid.uuid4().hex[:10]}-{uuid.uuid4().hex[:5]}"
            ip = f"127.{self._subnet}.{number // 200}.{10 + number % 200}"
            if self._ipv6:
                ip = "::1"
            self.pods[name] = Pod(
                name,
                str(uuid.uuid4()),
                deployment.name,
                dict(deployment.labels),
                ip,
                _now(),
                number,
                self._version(),
            )
        surplus = len(active) - deployment.replicas
        if surplus > 0:
            stale, self.stale_deletion_cost = self.stale_deletion_cost, False
            rank = _stale_deletion_rank if stale else _deletion_rank
            for pod in sorted(active, key=rank)[:surplus]:
                self.deleted.append(pod.name)
                self._delete(pod)

    def _write_status(self, deployment: Deployment) -> None:
        """The Deployment controller's status write (observedGeneration after a change of
        spec.replicas, status.replicas, status.readyReplicas), which, as every write of the
        object, gives it a new resourceVersion: a scale read before it is stale, and a PATCH
        conditional on its version is a 409 Conflict though nobody else scaled."""
        active = [p for p in self.pods.values() if p.deployment == deployment.name and p.active]
        status = (deployment.replicas, len(active), sum(p.ready for p in active))
        if status != deployment.status:
            deployment.status = status
            deployment.resource_version = self._version()

    def status_written(self, name: str) -> None:
        """The Deployment controller writes the Deployment's status (as it does a few times
        after each scale): a new resourceVersion, nothing else changed."""
        with self._changed:
            self.deployments[name].resource_version = self._version()
            self._changed.notify_all()

    def _delete(self, pod: Pod) -> None:
        pod.deletion_timestamp = _now()
        pod.deleting_since = time.monotonic()
        pod.resource_version = self._version()
        if pod.process is not None and pod.process.poll() is None:
            pod.process.send_signal(signal.SIGTERM)

    def _run(self, pod: Pod) -> None:
        now = time.monotonic()
        if pod.deleting_since is not None:
            if pod.process is None or pod.process.poll() is not None:
                del self.pods[pod.name]
            elif now - pod.deleting_since > _TERMINATION_GRACE_S:
                pod.process.kill()
            return
        if pod.failed_reason is not None:  # failed for good: never restarted
            return
        if pod.process is not None and pod.process.poll() is not None:  # the container exited
            pod.process = None
            pod.ready_since = None
            pod.restart_at = now + self._restart_delay_s
            pod.resource_version = self._version()
        if not pod.scheduled:
            if self.unschedulable:
                return
            pod.scheduled = True
            pod.resource_version = self._version()
        if pod.process is None and (pod.restart_at is None or now >= pod.restart_at):
            if not pod.sandboxed and self._reused_ips:
                pod.ip = self._reused_ips.pop(0)
            with (self._workdir / f"{pod.name}.log").open("ab") as log_file:
                pod.process = subprocess.Popen(
                    [sys.executable, "-m", "kvplane", "engine", "serve", *self._engine_args,
                     "--listen", self.address(pod)],
                    stdout=subprocess.DEVNULL, stderr=log_file,
                    env={**os.environ, **member_environment(None)},  # dies with this thread
                    start_new_session=True,  # a container is nobody's terminal job
                )  # fmt: skip
            pod.restarts += pod.sandboxed  # started before: this is a restart
            pod.restart_at = None
            pod.sandboxed = True
            pod.resource_version = self._version()


def _deletion_rank(pod: Pod) -> tuple[bool, bool, int, float, int]:
    """Kubernetes' order of pods to delete first (ascending)."""
    cost = int(pod.annotations.get(DELETION_COST, "0"))
    ready_since = pod.ready_since or 0.0
    return (pod.sandboxed, pod.ready, cost, -ready_since, -pod.number)  # Pending first


def _stale_deletion_rank(pod: Pod) -> tuple[bool, bool, int, float, int]:
    return (*_deletion_rank(pod)[:2], 0, *_deletion_rank(pod)[3:])


# The kubelet's default probe timeoutSeconds (the manifest sets none).
PROBE_TIMEOUT_S = 1.0


def _healthy(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _status(error: ApiError) -> dict[str, Any]:
    """The Status object the API server answers an error with."""
    status: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": error.message,
        "reason": error.reason,
        "code": error.code,
    }
    if error.retry_after_s is not None:
        status["details"] = {"retryAfterSeconds": error.retry_after_s}
    return status


def _fault_resource(parts: list[str]) -> str:
    """The resource a `Fault` names for a request's path."""
    if parts[-1] == "scale":
        return "deployments/scale"
    if "leases" in parts:
        return "leases"
    return "pods"


def _object(headers: Any, body: bytes, api_version: str, kind: str) -> dict[str, Any]:
    """A create's or an update's body: a JSON object of `kind` (the API server decodes a body
    as the type of its URL: another kind is a 400)."""
    sent = _json_body(headers, body, _OBJECT_TYPES, "body")
    if (sent.get("apiVersion"), sent.get("kind")) != (api_version, kind):
        raise ApiError(
            400,
            "BadRequest",
            f"the API version in the data ({sent.get('apiVersion')}) does not match the "
            f"expected API version ({api_version}) or kind ({sent.get('kind')}) {kind}",
        )
    return sent


def _lease_spec(lease: dict[str, Any], name: str) -> dict[str, Any]:
    """A Lease's spec as the API server validates it."""
    spec = lease.get("spec") or {}
    if not isinstance(spec, dict):
        raise ApiError(400, "BadRequest", "spec: not an object")
    for key in ("acquireTime", "renewTime"):
        value = spec.get(key)
        if value is not None and not (isinstance(value, str) and _RFC3339.match(value)):
            raise ApiError(400, "BadRequest", f"spec.{key}: {value!r} is not an RFC 3339 time")
    invalid = f'Lease.coordination.k8s.io "{name}" is invalid: spec.'
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        raise ApiError(422, "Invalid", f"{invalid}leaseDurationSeconds: must be greater than 0")
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        raise ApiError(
            422, "Invalid", f"{invalid}leaseTransitions: must be greater than or equal to 0"
        )
    return dict(spec)


def _merge_patch(headers: Any, body: bytes) -> dict[str, Any]:
    return _json_body(headers, body, _PATCH_TYPES, "patch")


def _json_body(headers: Any, body: bytes, types: set[str], what: str) -> dict[str, Any]:
    """A request's body: a JSON object sent as one of the media `types` (else 415)."""
    content_type = (headers.get("Content-Type") or "").split(";")[0].strip()
    if content_type not in types:
        raise ApiError(
            415, "UnsupportedMediaType", f'the body of the request was in an unknown format - '
            f'accepted media types include: {", ".join(sorted(types))}'
        )  # fmt: skip
    try:
        sent = json.loads(body)
    except ValueError as exc:
        raise ApiError(400, "BadRequest", f"error decoding {what}: {exc}") from exc
    if not isinstance(sent, dict):
        raise ApiError(400, "BadRequest", f"the {what} must be a JSON object")
    return sent


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _handler(kube: FakeKube) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if kube.delay_s:
                time.sleep(kube.delay_s)
            if kube.hangs(self.path):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(2**20))  # 14 hours of bytes
                self.end_headers()
                self.wfile.flush()
                kube.hang(self._write)
                self.close_connection = True
                return
            try:
                code, answer = kube.handle(self.command, self.path, self.headers, body)
            except ApiError as exc:
                code, answer, retry_after_s = exc.code, _status(exc), exc.retry_after_s
            else:
                retry_after_s = None
            data = json.dumps(answer).encode()
            chunked = len(data) > _GO_UNCHUNKED_BYTES
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(data)))
            if retry_after_s is not None:
                self.send_header("Retry-After", str(retry_after_s))
            self.end_headers()
            if not chunked:
                self.wfile.write(data)
                return
            for start in range(0, len(data), _GO_CHUNK_BYTES):
                chunk = data[start : start + _GO_CHUNK_BYTES]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")

        def _write(self, data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = _serve

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

    return Handler
