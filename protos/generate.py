"""Generate the Python stubs (messages, .pyi, gRPC) of every proto under protos/.

    python protos/generate.py [OUT_DIR]     (default: the repository root)

    protos/dockyard/<service>/v1/<service>.proto ──protoc──> dockyard/api/<service>/v1/<service>_pb2{,_grpc}.py{,i}

Generated code lives apart from hand-written code, in `dockyard/api/` only.
protoc names a stub's module after its proto path (`dockyard.<service>.v1`);
the import lines between stubs are rewritten to `dockyard.api.<service>.v1`,
so the Python package is tidy while every wire name (the proto package
`dockyard.<service>.v1`, services such as `dockyard.trainer.v1.TrainerService`,
message names) stays exactly what the protos say. The generated files are
committed; tests/contract/test_protos.py fails when they drift from the protos.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
# Where the stubs of protos/dockyard/... land, relative to the output folder.
API_PACKAGE = Path("dockyard", "api")
# `from dockyard.api.common.v1 import common_pb2 ...` in a stub -> `from dockyard.api.common.v1 import ...`.
_STUB_IMPORT = re.compile(r"^from dockyard\.(\w+\.v\d+) import ", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Write stubs for every .proto into out_dir/dockyard/api; return the files written."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as raw_dir:
        raw = Path(raw_dir)
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *(str(p) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {len(protos)} protos")
        for proto in protos:
            rel = proto.parent.relative_to(PROTO_ROOT / "dockyard")  # <service>/v1
            package_dir = out_dir / API_PACKAGE / rel
            package_dir.mkdir(parents=True, exist_ok=True)
            # Every generated folder is a regular package, so imports never depend
            # on namespace-package lookup order.
            for depth in range(len(rel.parts) + 1):
                init = out_dir.joinpath(*API_PACKAGE.parts, *rel.parts[:depth], "__init__.py")
                if not init.exists():
                    init.write_text("")
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                name = proto.stem + suffix
                text = (raw / "dockyard" / rel / name).read_text()
                (package_dir / name).write_text(_STUB_IMPORT.sub(r"from dockyard.api.\1 import ", text))
                written.append(package_dir / name)
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(out):
        print(path.relative_to(out))
