"""scripts/check_layers.py: the repository's import graph keeps its layers, and the checker
itself catches what it claims to (synthetic trees), so it cannot pass by seeing nothing."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_checker():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "scripts" / "check_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


check_layers = _load_checker()


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    """A minimal repository: shoal/, peer/, coordinator/ packages plus `files` (path -> source)."""
    for pkg in ("shoal/__init__.py", "shoal/common/__init__.py", "peer/__init__.py", "coordinator/__init__.py"):
        (root / pkg).parent.mkdir(parents=True, exist_ok=True)
        (root / pkg).write_text("")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def _rules(report: dict) -> list[tuple[str, str]]:
    return [(v["rule"], v["module"]) for v in report["violations"]]


def test_repository_keeps_its_layers():
    report = check_layers.check(ROOT)
    assert report["modules"] > 20, "the checker found almost no modules: wrong root?"
    assert "shoal.coordinator.rounds" in report["longest_functions"]
    assert not report["violations"], "\n" + check_layers.render(report)


def test_clean_tree_passes_and_main_exits_0(tmp_path, capsys):
    root = _tree(tmp_path, {
        "shoal/common/errors.py": "import grpc\n",
        "peer/agent.py": "from shoal.common import errors\nfrom . import data\n",
        "peer/workloads/digits.py": "import numpy\n",
        "coordinator/planner.py": "import math\n",
        "coordinator/rounds.py": "from .planner import math\n",
        "shoal/cli/__init__.py": "import shoal.peer.agent\nfrom shoal.coordinator import rounds\n",
    })
    report = check_layers.check(root)
    assert report["violations"] == [] and report["modules"] == 10
    assert check_layers.main(["--root", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["violations"] == []


def test_cycle_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "peer/a.py": "from shoal.peer import b\n",
        "peer/b.py": "from shoal.peer.c import thing\n",
        "peer/c.py": "import shoal.peer.a\nthing = 1\n",
        "peer/d.py": "from . import d\n",  # a self-loop
    })
    report = check_layers.check(root)
    cycles = [v["detail"] for v in report["violations"] if v["rule"] == "cycle"]
    assert cycles == ["import cycle: shoal.peer.a <-> shoal.peer.b <-> shoal.peer.c", "import cycle: shoal.peer.d"]
    assert check_layers.main(["--root", str(root)]) == 1


def test_peer_importing_coordinator_and_back_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "peer/agent.py": "from shoal.coordinator.rounds import RoundEngine\n",
        "coordinator/rounds.py": "RoundEngine = None\n",
        "coordinator/server.py": "import shoal.peer\n",
        "shoal/common/tickets.py": "from shoal import cli\n",  # base importing top
        "shoal/cli/__init__.py": "",
    })
    report = check_layers.check(root)
    assert sorted(_rules(report)) == [("layer", "shoal.common.tickets"), ("layer", "shoal.coordinator.server"),
                                      ("layer", "shoal.peer.agent")]


def test_relay_protocol_is_shared_and_the_relay_daemon_stays_off_the_peer(tmp_path):
    """The peer and the relay daemon both import the relay's protocol; the protocol imports only
    base, and the daemon (a top layer) never imports the peer or the coordinator."""
    root = _tree(tmp_path, {
        "shoal/relay/__init__.py": "",
        "shoal/relay/protocol.py": "from shoal.common import errors\nimport shoal.cli\n",  # base-like importing top
        "shoal/cli/__init__.py": "",
        "shoal/relay/server.py": "from shoal.relay.protocol import x\nfrom shoal.peer import agent\n",
        "shoal/common/errors.py": "",
        "peer/agent.py": "from shoal.relay.protocol import x\n",
        "coordinator/planner.py": "from shoal.relay import protocol\n",
        "shoal/testbeds/__init__.py": "",
        "shoal/testbeds/swarm.py": "import shoal.peer.agent\nimport shoal.relay.server\n",
    })
    report = check_layers.check(root)
    assert sorted(_rules(report)) == [("layer", "shoal.relay.protocol"), ("layer", "shoal.relay.server")]
    assert check_layers.layer_of("shoal.relay.protocol") == "protocol"
    assert check_layers.layer_of("shoal.bench.allreduce") == "shoal.bench"
    assert check_layers.layer_of("shoal.peer.workloads.lm") == "shoal.peer"


def test_lazy_import_inside_a_function_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "coordinator/rounds.py": """\
            class Engine:
                def plan(self):
                    if True:
                        from shoal.peer.collectives import auditor_positions
                        return auditor_positions
            """,
        "peer/collectives.py": "import grpc\ndef auditor_positions(): pass\n",
        "shoal/__init__.py": "def version():\n    import importlib\n    return importlib.import_module('shoal.cli')\n",
        "shoal/cli/__init__.py": "",
    })
    report = check_layers.check(root)
    layer = [v for v in report["violations"] if v["rule"] == "layer"]
    assert len(layer) == 1 and layer[0]["line"] == 4 and "lazily imports shoal.peer.collectives" in layer[0]["detail"]
    # The engine reaches the data plane, and grpc through it.
    engine = [v["detail"] for v in report["violations"] if v["rule"] == "engine"]
    assert any("data-plane module shoal.peer.collectives" in d for d in engine)
    assert any(d.startswith("reaches grpc (shoal.coordinator.rounds -> shoal.peer.collectives") for d in engine)
    # The namespace root imports nothing of shoal, not even lazily through importlib.
    assert ("root", "shoal") in _rules(report)


def test_engine_reaching_grpc_transitively_through_base_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "coordinator/planner.py": "from shoal.common.errors import Oops\n",
        "shoal/common/errors.py": "from shoal.common import status\nclass Oops(Exception): pass\n",
        "shoal/common/status.py": "from grpc_status import rpc_status\n",
    })
    (v,) = check_layers.check(root)["violations"]
    assert v["rule"] == "engine" and v["module"] == "shoal.coordinator.planner"
    assert "shoal.coordinator.planner -> shoal.common.errors -> shoal.common.status" in v["detail"]


@pytest.mark.parametrize("length, caught", [(check_layers.MAX_FUNCTION_LINES, False),
                                            (check_layers.MAX_FUNCTION_LINES + 1, True)])
def test_long_function_is_caught(tmp_path, length, caught):
    body = "".join(f"    x{i} = {i}\n" for i in range(length - 2))
    source = f"class Agent:\n    def run(self):\n        '''Doc.'''\n{textwrap.indent(body, '    ')}"
    root = _tree(tmp_path, {"peer/agent.py": source, "peer/workloads/digits.py": f"def long():\n{body}    return 0\n"})
    report = check_layers.check(root)
    (longest, *_) = report["longest_functions"]["shoal.peer.agent"]
    assert longest == {"function": "Agent.run", "line": 2, "lines": length}
    assert _rules(report) == ([("length", "shoal.peer.agent")] if caught else [])  # peer.workloads.digits is not length-checked
    assert "shoal.peer.rounds" in report["length_check_skipped"]  # not written: skipped, not an error


def test_nested_function_counts_inside_its_parent(tmp_path):
    inner = "".join(f"        y{i} = {i}\n" for i in range(120))
    root = _tree(tmp_path, {"peer/collectives.py": f"def outer():\n    def inner():\n{inner}    return inner\n"})
    details = [v["detail"] for v in check_layers.check(root)["violations"]]
    limit = check_layers.MAX_FUNCTION_LINES
    assert details == [f"outer is 123 lines (limit {limit})", f"outer.inner is 121 lines (limit {limit})"]
