import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
# Child processes (started with their own cwd) import the tree under test, not whatever checkout
# an editable install points at.
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH", "")])])

from procs import Procs  # noqa: E402


@pytest.fixture
def procs(tmp_path):
    """Start real processes in a test; every one is killed at teardown, also on failure."""
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.close()
