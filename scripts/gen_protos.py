"""Generate the Python modules for every .proto under proto/ (the one way they are made).

Usage: python scripts/gen_protos.py [OUT_DIR]

OUT_DIR defaults to proto/ itself (the checked-in copy); the freshness test generates into a
temporary folder and compares byte for byte. Needs grpcio-tools and mypy-protobuf (dev extra).
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(resources.files("grpc_tools") / "_proto")
    plugin_dir = Path(sys.executable).parent
    for proto in proto_files():
        rel = proto.relative_to(PROTO_ROOT)
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--plugin=protoc-gen-mypy={plugin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={plugin_dir / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={out_dir}",
            f"--mypy_grpc_out={out_dir}",
            str(rel),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {rel}")
    # Packages need an __init__.py each so that they import as openengine.v1, ...
    for proto in proto_files():
        package_dir = out_dir / proto.relative_to(PROTO_ROOT).parent
        for folder in [package_dir, *package_dir.relative_to(out_dir).parents]:
            init = out_dir / folder / "__init__.py" if folder != Path(".") else None
            if init is not None and not init.exists():
                init.write_text("")
        (package_dir / "py.typed").write_text("")


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    if out_dir != PROTO_ROOT and out_dir.exists():
        shutil.rmtree(out_dir)
    generate(out_dir)


if __name__ == "__main__":
    main()
