"""README's test command on a machine without the optional extras (torch, transformers): every
test file still collects, the tests that need an extra skip saying which, none errors."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# As on a machine without them: `import torch` raises ModuleNotFoundError (so pytest.importorskip
# skips) and importlib.util.find_spec("torch") is None.
BLOCK_AND_COLLECT = """
import importlib.util
import sys

BLOCKED = ("torch", "transformers")


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in BLOCKED else real_find_spec(name, package))
sys.meta_path.insert(0, NotInstalled())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "tests"]))
"""


def test_every_test_file_collects_without_torch_and_transformers():
    proc = subprocess.run([sys.executable, "-c", BLOCK_AND_COLLECT], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " error" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
