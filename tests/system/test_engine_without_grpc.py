"""The coordinator's engine (rounds, planner) works with grpc absent: in a fresh interpreter
where every grpc module is unimportable, its unit tests pass. scripts/check_layers.py checks the
same statically; this catches what only shows at run time (a lazy import on some code path)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Runs in the child. grpc and its submodules resolve to None in sys.modules (import fails at once);
# a finder refuses the grpc_* companions (grpc_health, grpc_reflection, grpc_tools, ...) too.
CHILD = r"""
import importlib.abc, sys

class _NoGrpc(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith(("grpc.", "grpc_")):
            raise ImportError(f"{name} is blocked: the engine must not need grpc")
        return None

for name in ("grpc", "grpc.aio", "grpc.experimental", "grpc._utilities"):
    sys.modules[name] = None
sys.meta_path.insert(0, _NoGrpc())

# Imported before pytest, so that no plugin can have pulled grpc in first.
import shoal.coordinator.rounds, shoal.coordinator.planner  # noqa: E401,F401
import pytest

# In this interpreter (-n 0): xdist's workers would be fresh interpreters without the block above.
sys.exit(pytest.main(["-q", "--tb=line", "-n", "0", "-p", "no:cacheprovider", "tests/unit/test_rounds.py",
                      "tests/unit/test_planner.py"]))
"""


def test_engine_unit_tests_pass_without_grpc():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, \
        f"engine tests without grpc (exit {out.returncode}):\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    assert " passed" in out.stdout and "failed" not in out.stdout, out.stdout[-3000:]
