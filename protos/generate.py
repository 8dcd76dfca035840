"""Generate the Python stubs (messages, .pyi, gRPC) of every proto under protos/.

    python protos/generate.py [OUT_DIR]     (default: the repository root)

Stubs land at the path of their proto package (dockyard/coordinator/v1/...),
so `import dockyard.coordinator.v1.coordinator_pb2` mirrors the proto package.
The generated files are committed; tests/contract/test_stubs_fresh.py fails
when they drift from the protos.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def generate(out_dir: Path) -> list[Path]:
    """Write stubs for every .proto into out_dir; return the files written."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {len(protos)} protos")
    written = []
    for proto in protos:
        rel = proto.parent.relative_to(PROTO_ROOT)
        package_dir = out_dir / rel
        # Every generated folder is a regular package, so imports never depend
        # on namespace-package lookup order.
        for depth in range(1, len(rel.parts) + 1):
            init = out_dir.joinpath(*rel.parts[:depth], "__init__.py")
            if not init.exists():
                init.write_text("")
        stem = proto.stem
        written += [
            package_dir / f"{stem}_pb2.py",
            package_dir / f"{stem}_pb2.pyi",
            package_dir / f"{stem}_pb2_grpc.py",
        ]
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(out):
        print(path.relative_to(out))
