"""Regenerate the Python gRPC code in shoal/v1/ from protos/shoal/v1/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]
The generated files are committed; tests/unit/test_protos.py fails when they are stale.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (grpcio-tools) over every .proto under protos/ into `out`; returns the files written."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted((ROOT / "protos").rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT / 'protos'}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in (out / "shoal" / "v1").glob("*_pb2*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    sys.exit(main())
