"""The checked-in protos are the seeds' text, and the generated code is fresh."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from kv_indexer.v1 import kv_indexer_pb2
from openengine.v1 import openengine_pb2
from vllm_grpc import vllm_grpc_pb2

REPO = Path(__file__).resolve().parents[2]
SEEDS = REPO.parent / "shared" / "seeds" / "extracted"

# (checked-in proto, seed text, generated module)
SEED_PROTOS = [
    ("openengine/v1/openengine.proto", "openengine.proto", openengine_pb2),
    ("kv_indexer/v1/kv_indexer.proto", "kv_indexer.proto", kv_indexer_pb2),
    ("vllm_grpc/vllm_grpc.proto", "vllm_grpc.proto", vllm_grpc_pb2),
]


@pytest.mark.parametrize(("ours", "seed", "_module"), SEED_PROTOS)
def test_seed_protos_are_transcribed_verbatim(ours: str, seed: str, _module: object) -> None:
    # Every message, field, enum, comment and option of a seed stays exactly as written.
    assert (REPO / "proto" / ours).read_text() == (SEEDS / seed).read_text()


def _seed_descriptor(seed: str, tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    out = tmp_path / f"{seed}.pb"
    include = str(resources.files("grpc_tools") / "_proto")
    rc = protoc.main(
        ["grpc_tools.protoc", f"-I{SEEDS}", f"-I{include}", f"--descriptor_set_out={out}", seed]
    )
    assert rc == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    file = fds.file[0]
    # protoc fills in json_name; the runtime descriptor leaves the default implicit.
    for message in file.message_type:
        _clear_json_names(message)
    return file


def _clear_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _clear_json_names(nested)


@pytest.mark.parametrize(("_ours", "seed", "module"), SEED_PROTOS)
def test_generated_descriptors_equal_the_seeds(
    _ours: str, seed: str, module: object, tmp_path: Path
) -> None:
    expected = _seed_descriptor(seed, tmp_path)
    actual = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(actual)  # type: ignore[attr-defined]
    assert actual.package == expected.package
    assert list(actual.dependency) == list(expected.dependency)
    # Compare every message (fields with numbers, types, labels, oneofs, proto3 optional),
    # enum and service, independent of the file's path.
    for name in ("message_type", "enum_type", "service"):
        got = [m.SerializeToString(deterministic=True) for m in getattr(actual, name)]
        want = [m.SerializeToString(deterministic=True) for m in getattr(expected, name)]
        assert got == want, f"{seed}: {name} differs"
    assert actual.options == expected.options


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos.py"), str(out)],
        check=True,
        capture_output=True,
    )
    generated = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert generated, "the generator produced nothing"
    checked_in = sorted(
        p.relative_to(REPO / "proto")
        for p in (REPO / "proto").rglob("*")
        if p.is_file() and p.suffix != ".proto" and "__pycache__" not in p.parts
    )
    assert checked_in == generated, "generated files differ from the checked-in set"
    for rel in generated:
        assert filecmp.cmp(out / rel, REPO / "proto" / rel, shallow=False), (
            f"proto/{rel} is stale: run `make protos`"
        )


def test_generated_modules_do_not_shadow_well_known_packages() -> None:
    # `proto` is proto-plus's import name and `vllm` is vLLM's.
    assert not (REPO / "proto" / "__init__.py").exists()
    assert not (REPO / "proto" / "vllm").exists()
    assert vllm_grpc_pb2.DESCRIPTOR.package == "vllm"
