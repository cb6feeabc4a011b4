"""Servicer bases for test engines and indexes that implement only the RPCs a test needs.

The generated stubs (mypy-protobuf) mark every RPC of a servicer abstract, so mypy would refuse
to build a test servicer that leaves one out; at runtime the generated base answers each RPC left
out with UNIMPLEMENTED, which is what these tests rely on (an engine without runtime events, an
index that only matches). The RPCs are declared here without a value: mypy takes them as given,
and at runtime the generated base's methods still answer.
"""

from collections.abc import Callable
from typing import Any

from kvplane_api.v1 import admin_pb2_grpc as admin_grpc
from kvplane_api.v1 import index_pb2_grpc as index_grpc
from kvplane_api.v1 import kv_transfer_pb2_grpc as kv_transfer_grpc
from openengine.v1 import openengine_pb2_grpc as openengine_grpc
from vllm_grpc import vllm_grpc_pb2_grpc as vllm_grpc

Rpc = Callable[..., Any]


class PartialOpenEngine(openengine_grpc.OpenEngineServicer):
    """An OpenEngine servicer; the RPCs a subclass leaves out answer UNIMPLEMENTED."""

    Generate: Rpc
    Embed: Rpc
    Classify: Rpc
    Score: Rpc
    GetEngineInfo: Rpc
    GetModelInfo: Rpc
    GetLoad: Rpc
    Health: Rpc
    Abort: Rpc
    Drain: Rpc
    LoadLora: Rpc
    UnloadLora: Rpc
    ListLoras: Rpc
    GetKvConnectorInfo: Rpc
    GetKvEventSources: Rpc
    SubscribeKvEvents: Rpc
    SubscribeRuntimeEvents: Rpc


class PartialAdmin(admin_grpc.AdminServicer):
    """A controller's Admin servicer; the RPCs a subclass leaves out answer UNIMPLEMENTED."""

    ListWorkers: Rpc
    RegisterEngine: Rpc
    RemoveEngine: Rpc
    Cordon: Rpc
    Uncordon: Rpc
    DrainEngine: Rpc
    Route: Rpc
    Match: Rpc
    CheckAccess: Rpc


class PartialKvIndex(index_grpc.KvIndexServicer):
    """A KvIndex servicer; the RPCs a subclass leaves out answer UNIMPLEMENTED."""

    MatchTokens: Rpc
    GetIndexStats: Rpc
    DumpIndex: Rpc
    ResyncEngine: Rpc


class PartialKvTransfer(kv_transfer_grpc.KvTransferServicer):
    """A KvTransfer servicer; the RPCs a subclass leaves out answer UNIMPLEMENTED."""

    PullKvSession: Rpc
    ReleaseKvSession: Rpc


class PartialVllmGenerate(vllm_grpc.GenerateServicer):
    """A `vllm.Generate` servicer; the RPCs a subclass leaves out answer UNIMPLEMENTED."""

    Generate: Rpc
    GenerateStream: Rpc
