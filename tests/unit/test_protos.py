"""The committed generated code in shoal/v1 must match what protos/ generates."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools (dev extra) not installed")
def test_generated_code_is_fresh(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    gen_protos.generate(tmp_path)
    fresh = sorted((tmp_path / "shoal" / "v1").glob("*_pb2*"))
    assert fresh, "protoc generated nothing"
    for f in fresh:
        committed = ROOT / "shoal" / "v1" / f.name
        assert committed.exists(), f"{committed} missing: run python scripts/gen_protos.py"
        assert committed.read_bytes() == f.read_bytes(), f"{committed.name} is stale: run python scripts/gen_protos.py"
