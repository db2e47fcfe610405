#!/usr/bin/env python3
"""Generate the Python gRPC stubs for proto/kvstore.proto into kvstore/_proto/.

Usage: python scripts/gen_proto.py [--out DIR]

Needs grpcio-tools (installed by the `dev` extra). The generated files are
committed; tests/test_proto.py regenerates them into a temporary folder and
fails when they differ from the committed ones.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
DEFAULT_OUT = ROOT / "kvstore" / "_proto"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on proto/kvstore.proto, writing the stubs into ``out``.

    Returns the generated files. Raises RuntimeError when protoc fails.
    """
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO_DIR / "kvstore.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/kvstore.proto")
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
    args = parser.parse_args()
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
