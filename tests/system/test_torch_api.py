"""shoal.torch against a real coordinator process: a torch LR scheduler on the swarm optimizer,
state_dict / load_state_dict, the user's own outer optimizer, round_timeout; under soak, README's
PyTorch snippet as written against a TLS + token coordinator, its refusal without TLS, and a
restarted trainer that rejoins as the same member."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'shoal[torch]')")

import shoal.torch as st  # noqa: E402
from kits.cli import shoal  # noqa: E402
from shoal.cli.status import fetch_status  # noqa: E402
from shoal.common.identity import load_key, peer_id_of, public_bytes  # noqa: E402
from shoal.common.security import Security  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.torch, pytest.mark.integration]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.timeout(120)
def test_scheduler_state_dict_and_own_outer_optimizer_in_a_real_swarm(procs, tmp_path):
    """One trainer (min_peers 1), 3 rounds of 4 inner steps: a LambdaLR keyed on committed_rounds
    sets the inner optimizer's lr each round; state_dict holds the counters and the committed state,
    and load_state_dict of it round-trips; the user's SGD-Nesterov outer is what the commits apply."""
    _, addr = procs.coordinator("--rounds", "3", "--min-peers", "1", "--initial-peers", "1", "--inner-steps", "4",
                                "--algorithm", "diloco")
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = st.DiLoCoOptimizer(model, inner, coordinator=addr, insecure=True, key_path=tmp_path / "t.key",
                             outer_optimizer=outer, round_timeout=60, join_timeout=30)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 0.5 ** opt.committed_rounds)
    x, y = torch.randn(32, 6, generator=torch.Generator().manual_seed(1)), torch.randn(32, 2)
    lrs: dict[int, float] = {}
    with opt:
        assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is inner.param_groups
        while not opt.finished:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            lrs.setdefault(opt.committed_rounds, inner.param_groups[0]["lr"])
            opt.step(loss=loss.item())
            sched.step()
            opt.zero_grad()
        sd = opt.state_dict()
    # the phase after the last commit runs too, until the coordinator says the run is over
    assert lrs == {0: 1e-2, 1: 5e-3, 2: 2.5e-3, 3: 1.25e-3}, lrs
    shoal_sd = sd["shoal"]
    assert shoal_sd["committed_rounds"] == 3 and shoal_sd["local_step"] == 16 and shoal_sd["rounds"] == 3
    assert shoal_sd["outer"]["name"] == "torch.SGD" and int(shoal_sd["outer"]["state"]["step"]) == 3
    np_final = st.flatten(model)
    assert torch.equal(shoal_sd["committed_params"], torch.from_numpy(np_final))
    opt.load_state_dict(sd)  # not newer than what it holds: the inner state and counters only
    again = opt.state_dict()
    assert again["shoal"]["local_step"] == 16 and torch.equal(again["shoal"]["committed_params"],
                                                              shoal_sd["committed_params"])
    assert again["inner"]["state"][0]["exp_avg"].equal(sd["inner"]["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="state_dict"):
        opt.load_state_dict({"state": {}})


@pytest.mark.timeout(90)
def test_round_timeout_raises_a_named_error_when_the_swarm_cannot_open_a_round(procs, tmp_path):
    _, addr = procs.coordinator("--rounds", "3", "--min-peers", "2", "--initial-peers", "2", "--inner-steps", "2")
    model = _model()
    opt = st.DiLoCoOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), coordinator=addr, insecure=True,
                             key_path=tmp_path / "t.key", round_timeout=2.0, join_timeout=30)
    with opt:
        x = torch.randn(4, 6)
        model(x).sum().backward()
        opt.step()
        t = time.monotonic()
        with pytest.raises(st.RoundTimeout, match="round_timeout=2s"):
            opt.step()  # the 2nd step ends the phase: nobody else is there to open the round
        assert 1.5 < time.monotonic() - t < 10
        assert not opt.finished and opt.committed_rounds == 0


@pytest.mark.timeout(150)
def test_two_trainers_take_the_coordinators_topk_codec_and_send_one_sparse_payload_a_round(procs, tmp_path):
    """The run's settings reach a torch trainer at join: against a coordinator running
    `--compression topk`, two DiLoCoOptimizer trainers (threads of this process, different data)
    send per round exactly one sparse payload to the other (the sparse all-gather: (p-1) x
    payload bytes: 160, 1/117 of the 4n a float32 ring sends here) and end on bit-identical parameters that
    moved off the start."""
    from shoal.peer.sparse import SparseCodec

    chunk, k, bits, rounds = 1024, 16, 2, 3
    _, addr = procs.coordinator("--rounds", str(rounds), "--min-peers", "2", "--initial-peers", "2",
                                "--inner-steps", "3", "--algorithm", "diloco", "--compression", "topk",
                                "--sparse-chunk", str(chunk), "--sparse-k", str(k), "--sparse-bits", str(bits))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    start = st.flatten(model()).copy()
    finals: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def train(i: int) -> None:
        try:
            m = model()
            g = torch.Generator().manual_seed(10 + i)
            x, y = torch.randn(64, 64, generator=g), torch.randn(64, 8, generator=g)
            with st.DiLoCoOptimizer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), coordinator=addr, insecure=True,
                                    key_path=tmp_path / f"t{i}.key", round_timeout=60, join_timeout=30,
                                    events_path=str(tmp_path / f"events-{i}.jsonl")) as opt:
                while not opt.finished:
                    loss = torch.nn.functional.mse_loss(m(x), y)
                    loss.backward()
                    opt.step(loss=loss.item())
                    opt.zero_grad()
                finals[i] = st.flatten(m).copy()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(finals) == [0, 1] and np.array_equal(finals[0], finals[1])
    assert not np.array_equal(finals[0], start)
    n = start.size
    payload = SparseCodec("topk", chunk, k, bits).payload_bytes(n)
    for i in range(2):
        events = [json.loads(line) for line in (tmp_path / f"events-{i}.jsonl").read_text().splitlines()]
        sent = [e["bytes_sent"] for e in events if e["event"] == "collective"]
        assert len(sent) == rounds and all(b == payload for b in sent), (sent, payload)
        assert payload * 100 < 4 * n
    assert fetch_status(addr)["compression"]["name"] == "topk"


# ------------------------------------------------------------------------------ README's snippet, TLS + token


def _snippet() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## PyTorch integration", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _trainer(procs, name: str, code: str, env: dict) -> subprocess.Popen:
    with open(procs.workdir / f"{name}.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-c", code], cwd=procs.workdir, env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    p.name = name  # type: ignore[attr-defined]
    procs.procs.append(p)  # killed at teardown like the others
    return p


@pytest.mark.soak  # 3 processes and 2 trainer starts: ~40 s; the default run covers the API above
@pytest.mark.timeout(300)
def test_readme_snippet_joins_a_tls_token_coordinator_refuses_plaintext_and_rejoins_as_one_member(procs, tmp_path):
    wd = procs.workdir
    assert shoal("certs", "init", "--out", str(wd / "tls"), "--host", "127.0.0.1").returncode == 0
    tokens = {}
    for who in ("alice", "bob"):
        made = shoal("token", "create", "--secret", str(wd / "join.secret"), "--ttl", "600", "--label", who)
        assert made.returncode == 0, made.stderr
        tokens[who] = made.stdout.strip()
        (wd / who).mkdir()
        (wd / who / "ca.pem").write_bytes((wd / "tls" / "ca.pem").read_bytes())
    _, addr = procs.coordinator("--tls-dir", str(wd / "tls"), "--join-token-secret", str(wd / "join.secret"),
                                "--rounds", "0", "--min-peers", "1", "--initial-peers", "2", "--inner-steps", "25")
    code = _snippet().replace("coord.example.org:7070", addr)
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env = {who: {**base, "SHOAL_JOIN_TOKEN": tokens[who], "XDG_DATA_HOME": str(wd / f"data-{who}")}
           for who in tokens}
    sec = Security(tls_dir=str(wd / "alice"))

    def status() -> dict:
        return fetch_status(addr, security=sec)

    # bob keeps the committed state while alice restarts (a restarted trainer syncs it from a member)
    _trainer(procs, "bob", code.replace('tls_dir="alice"', 'tls_dir="bob"'), env["bob"])
    first = _trainer(procs, "alice", code, env["alice"])
    procs.wait_for("2 rounds committed by the README snippet", lambda: status()["rounds_committed"] >= 2, 120)
    first.kill()
    first.wait(10)
    alice = peer_id_of(public_bytes(load_key(wd / "data-alice" / "shoal" / "peer-1.key")))
    at = status()["rounds_committed"]
    again = _trainer(procs, "alice-again", code, env["alice"])  # the same arguments and environment
    procs.wait_for("a round committed with the restarted trainer",
                   lambda: status()["rounds_committed"] >= at + 1 and again.poll() is None and any(
                       r["status"] == "committed" and r["round"] >= at and r["participants"] == 2
                       for r in status()["rounds"]), 150)
    listed = shoal("member", "list", "--coordinator", addr, "--tls-dir", str(wd / "alice"), "--admin-key",
                   str(wd / "coordinator.key"), "--json")
    assert listed.returncode == 0, listed.stderr
    members = [m["member"] for m in json.loads(listed.stdout)["members"]]
    assert len(members) == 2 and members.count(alice) == 1, members
    again.kill()

    plain = subprocess.run([sys.executable, "-c", code.replace(', tls_dir="alice"', "")], cwd=wd, env=env["alice"],
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1
    last = plain.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: pass tls_dir=DIR") and "insecure=True" in last, plain.stderr[-2000:]
