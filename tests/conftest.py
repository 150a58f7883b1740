import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from procs import Procs  # noqa: E402


@pytest.fixture
def procs(tmp_path):
    """Start real processes in a test; every one is killed at teardown, also on failure."""
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.close()
