#!/usr/bin/env python3
"""Generate the Python gRPC stubs for proto/kvstore.proto into kvstore/_proto/.

Usage: python scripts/gen_proto.py [--out DIR]

The one source of truth for the stubs. They are generated with a pinned, older
grpcio-tools (:data:`GRPC_TOOLS_VERSION`) so that they load under every protobuf /
grpcio pair that kvstore supports, including the engines' pins (vLLM allows protobuf
>= 5.29, LMCache-style environments pin protobuf 6.x):

- the protobuf gencode checks only that the runtime is not older than the gencode
  (:data:`PROTOBUF_GENCODE`, so protobuf >= 5.29.0 works, 6.x and 7.x included);
- the gRPC stub checks ``grpcio >= GRPC_TOOLS_VERSION``.

That grpcio-tools needs protobuf < 6, so it runs in a tool environment of its own,
``.venv-protoc`` (created on first use with pip; ignored by git), unless the current
interpreter already has exactly that version. The generated files are committed;
tests/kvstore/test_proto.py regenerates them into a temporary folder and fails when they differ.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
DEFAULT_OUT = ROOT / "kvstore" / "_proto"
GRPC_TOOLS_VERSION = "1.71.2"
PROTOBUF_GENCODE = "5.29.0"          # what grpcio-tools 1.71.2's protoc writes into the gencode
TOOL_VENV = ROOT / ".venv-protoc"


def _tools_version() -> str | None:
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return None


def tool_python() -> pathlib.Path:
    """The interpreter of the tool environment, created with the pinned grpcio-tools if
    missing. Raises RuntimeError when it cannot be built (e.g. no package index)."""
    python = TOOL_VENV / "bin" / "python"
    stamp = TOOL_VENV / f".grpcio-tools-{GRPC_TOOLS_VERSION}"
    if python.exists() and stamp.exists():
        return python
    try:
        subprocess.run([sys.executable, "-m", "venv", str(TOOL_VENV)], check=True, capture_output=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"grpcio-tools=={GRPC_TOOLS_VERSION}"],
                       check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"could not build {TOOL_VENV} with grpcio-tools=={GRPC_TOOLS_VERSION}: "
                           f"{(e.stderr or '')[-500:]}") from None
    stamp.touch()
    return python


def _protoc(out: pathlib.Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}",
            str(PROTO_DIR / "kvstore.proto")]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/kvstore.proto")


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Run the pinned protoc on proto/kvstore.proto, writing the stubs into ``out``.

    Returns the generated files. Raises RuntimeError when protoc fails or the tool
    environment cannot be built.
    """
    out = pathlib.Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if _tools_version() == GRPC_TOOLS_VERSION:
        _protoc(out)
    else:
        done = subprocess.run([str(tool_python()), __file__, "--out", str(out), "--protoc-only"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"protoc in {TOOL_VENV} failed: {done.stderr[-1000:]}")
    grpc_file = out / "kvstore_pb2_grpc.py"
    # protoc emits an absolute import; make it relative to the package.
    text = grpc_file.read_text()
    text = re.sub(r"^import kvstore_pb2 as", "from . import kvstore_pb2 as", text, flags=re.M)
    grpc_file.write_text(text)
    init = out / "__init__.py"
    init.write_text('"""Generated gRPC stubs (scripts/gen_proto.py). Do not edit."""\n')
    return [out / "kvstore_pb2.py", grpc_file, init]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--protoc-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.protoc_only:
        _protoc(args.out)
        return 0
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
