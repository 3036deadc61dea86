"""Regenerate the checked-in Python code from the .proto files: `python -m protos.generate`.

Run from anywhere; needs grpcio-tools (the `test` extra). Files are compiled with the repository
root as the include path, so the generated modules import each other by package path
(`protos.mmserve.v1.vlm_pb2`) and never shadow the top-level `mmserve` package.
`tests/unit/test_protos.py` fails when the checked-in code drifts from the .proto files.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos" / "mmserve" / "v1"


def proto_files() -> list[str]:
    """The .proto files, relative to the repository root (their names in the descriptor pool)."""
    return sorted(str(p.relative_to(REPO_ROOT)) for p in PROTO_DIR.glob("*.proto"))


def _protoc(args: list[str]) -> None:
    from grpc_tools import protoc

    include = str(Path(protoc.__file__).parent / "_proto")
    code = protoc.main(["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{include}", *args, *proto_files()])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


def generate(out_dir: Path = REPO_ROOT) -> None:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` under `out_dir/protos/mmserve/v1/`."""
    (Path(out_dir) / "protos" / "mmserve" / "v1").mkdir(parents=True, exist_ok=True)
    _protoc([f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"])


def descriptor_set(out_file: Path) -> None:
    """Write the compiled FileDescriptorSet of the .proto files (what the drift test compares)."""
    _protoc([f"--descriptor_set_out={out_file}"])


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
    print("generated:", ", ".join(proto_files()))
