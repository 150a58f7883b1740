import logging
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
# Child processes (started with their own cwd) import the tree under test, not whatever checkout
# an editable install points at.
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH", "")])])

from kits.procs import Procs  # noqa: E402


def _byte_compile_tree() -> None:
    """Write the bytecode of the tree under test once per session. Where PYTHONDONTWRITEBYTECODE
    is set (this project's CI image sets it) no process caches what it compiles, so every
    process a test starts compiled every module it imports again: ~0.3 s of CPU each here
    (`shoal.peer.agent` + `shoal.cli`: 1.0 s to import without the cache, 0.7 s with it). The
    variable only stops writing; cached bytecode is still read."""
    import compileall

    for package in ("shoal", "peer", "coordinator"):
        compileall.compile_dir(pathlib.Path(_ROOT) / package, quiet=1)


_byte_compile_tree()


@pytest.fixture(scope="session")
def netbed_available():
    """Skips the test unless network namespaces can be built here. Probed when a test first needs
    it, not at import: the probe runs `ip netns`, which collecting the fast tier must not."""
    from shoal.testbeds.netbed import NetBed

    ok, why = NetBed.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """Tests that run the CLI in this process (`shoal.cli.main`) configure the root logger with a
    handler on the sys.stderr of that moment, pytest's capture of that test, closed after it: a
    later test's log records then failed with "Logging error ... I/O operation on closed file".
    After every test the handlers it added go (pytest's own, which it adds and removes around
    each phase, stay) and the root level is restored."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            if h not in before and not type(h).__module__.startswith("_pytest"):
                root.removeHandler(h)
        root.setLevel(level)


@pytest.fixture
def procs(tmp_path):
    """Start real processes in a test; every one is killed at teardown, also on failure."""
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.close()


# The tiers (README, "Tests"): tests/unit (no sockets, no processes), tests/component (in-process
# gRPC and loopback sockets), tests/system (real processes, namespaces, containers, etcd).
SYSTEM = pathlib.Path(__file__).resolve().parent / "system"


# Fixtures that start real OS processes: a test using one belongs to the integration tier.
PROCESS_FIXTURES = frozenset({"procs"})


# Files whose tests take minutes in all: collected first, so a test worker starts on them while
# the other takes the rest (with `--dist loadfile` a file is one unit of work; the compose test,
# 2-3 minutes with its image build, made the last minutes of a run one worker's alone).
LONG_FILES = ("test_compose.py",)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything
def pytest_collection_modifyitems(config, items):
    """The tiers are folders: every test under tests/system is `integration`, so
    `-m "not integration"` never starts processes. Safety net for the other folders (a warning,
    since such a test is in the wrong folder): a test that asks for a process fixture, or a soak
    test, is `integration` too. Then LONG_FILES first (a stable sort: every worker collects the
    same order)."""
    items.sort(key=lambda item: item.path.name not in LONG_FILES)
    for item in items:
        if SYSTEM in item.path.parents:
            item.add_marker(pytest.mark.integration)
            continue
        if item.get_closest_marker("integration") is not None:
            continue
        why = sorted(PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())))
        if why or item.get_closest_marker("soak") is not None:
            item.add_marker(pytest.mark.integration)
            item.warn(pytest.PytestWarning(
                f"{item.nodeid} {'uses ' + ', '.join(why) if why else 'is soak'} but is not marked integration"))
