"""A machine without the optional extras (torch, transformers): every test file of README's test
command still collects (the tests that need an extra skip, saying which), and the examples that
need them say so in one line."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# As on a machine without them: `import torch` raises ModuleNotFoundError (so pytest.importorskip
# skips) and importlib.util.find_spec("torch") is None.
BLOCK = """
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
"""
COLLECT = BLOCK + """
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "tests"]))
"""


def test_every_test_file_collects_without_torch_and_transformers():
    proc = subprocess.run([sys.executable, "-c", COLLECT], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " error" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


@pytest.mark.parametrize("example, says", [("torch_digits.py", "needs torch: pip install -e \".[torch]\""),
                                           ("hf_causal_lm.py", "needs torch and transformers: pip install -e \".[hf]\"")])
def test_an_example_without_its_extra_says_what_to_install(example, says):
    run = BLOCK + f"""
import runpy
sys.argv = [{str(ROOT / "examples" / example)!r}, "--peers", "2"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    proc = subprocess.run([sys.executable, "-c", run], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == f"{example} {says}", proc.stderr[-2000:]
