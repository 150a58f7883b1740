"""deploy/docker-compose.yml for real: the image from deploy/Dockerfile, a coordinator, four peers,
Prometheus and the SeaweedFS checkpoint store as containers; rounds commit, Prometheus scrapes all
five targets, the elected peers' checkpoints reach the store (S3 credentials from the environment),
a killed peer container rejoins and syncs, a restarted coordinator container resumes from its
volume.

Runs on a Docker engine (`docker info` works) or on podman + podman-compose; on a machine without
a registry, `../shared/tools/container-engine.sh` (run as root; `.ci/run` calls it when there is
no Docker engine) installs podman and builds stand-ins for the base images. Skips, saying so,
where neither engine exists. Each run has its own compose project, image tag and host ports, so
a busy 7070/9090 on the host or another run at the same time does not disturb it; `down -v`
runs whatever happens. Every wait is bounded; no timing is asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shlex
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import pytest

from shoal.cli.status import fetch_status

pytestmark = [pytest.mark.integration, pytest.mark.compose]

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"
PEERS = ("peer1", "peer2", "peer3", "peer4")
SERVICES = ("seaweedfs", "coordinator", *PEERS, "prometheus")  # not grafana: podman-compose 1.0.x ignores profiles
NO_ENGINE = ("no container engine: neither a Docker engine (`docker info` fails or docker is absent) nor podman "
             "with podman-compose; as root, ../shared/tools/container-engine.sh installs podman (.ci/run does)")


def _ok(argv: list[str], timeout: float = 30) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Compose:
    """One compose project on one engine. Docker names services; podman-compose 1.0.x has no
    `kill` and drops `exec`'s exit status, so with podman the containers (`<project>_<service>_1`)
    are driven by podman itself."""

    engine: str  # "docker" | "podman"
    compose: list[str]
    project: str
    env: dict[str, str] = field(default_factory=dict)

    def _run(self, argv: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env={**os.environ, **self.env}, stdin=subprocess.DEVNULL)
        if check and out.returncode != 0:
            raise AssertionError(f"{shlex.join(argv)} exited {out.returncode}:\n{out.stdout[-2000:]}\n"
                                 f"{out.stderr[-2000:]}")
        return out

    def compose_cmd(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return self._run([*self.compose, "-p", self.project, "-f", str(COMPOSE_FILE), *args], timeout, check)

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def service_cmd(self, action: str, service: str, *args: str, timeout: float = 120,
                    check: bool = True) -> subprocess.CompletedProcess:
        """`action` (exec, kill, stop, start, logs) on one service's container."""
        if self.engine == "docker":
            extra = ("-T",) if action == "exec" else ()
            return self.compose_cmd(action, *extra, service, *args, timeout=timeout, check=check)
        flags = {"logs": ["--tail", "40"], "stop": ["-t", "30"]}.get(action, [])
        return self._run(["podman", action, *flags, self.container(service), *args], timeout, check)

    def logs(self, service: str) -> str:
        with contextlib.suppress(Exception):
            out = self.service_cmd("logs", service, *(["--tail", "40"] if self.engine == "docker" else []),
                                   timeout=30, check=False)
            return (out.stdout + out.stderr)[-3000:]
        return ""


def find_engine(project: str) -> tuple[Compose | None, str]:
    """The engine to run on, or None and why not."""
    docker = shutil.which("docker")
    if docker and _ok([docker, "info"]):
        if _ok([docker, "compose", "version"]):
            return Compose("docker", [docker, "compose"], project), ""
        if shutil.which("docker-compose"):
            return Compose("docker", ["docker-compose"], project), ""
        return None, "a Docker engine but no compose (the docker compose plugin or docker-compose)"
    podman, podman_compose = shutil.which("podman"), shutil.which("podman-compose")
    if podman and podman_compose and _ok([podman, "info"], timeout=60):
        return Compose("podman", [podman_compose], project), ""
    return None, NO_ENGINE


def healthcheck(service: str) -> list[str]:
    """The service's healthcheck from the compose file, as a command for `exec`: the test runs
    the very checks the file declares (podman runs them on its own only under systemd)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    anchor = doc["services"][service]
    test = anchor["healthcheck"]["test"]
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", test[1]]
    assert test[0] == "CMD", test
    return list(test[1:])


def wait_until(what: str, check, timeout: float, swarm: Compose, services=SERVICES, every: float = 2.0):
    """check()'s first truthy value; fails naming `what` (with the containers' logs) after `timeout`."""
    end = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except Exception as exc:  # noqa: BLE001 - a service not up yet; reported at the deadline
            last = exc
        if time.monotonic() > end:
            # The coordinator last, and a status snapshot at the very end: a CI report keeps the
            # head and the tail of a long failure, and the tail is what explains a stall.
            order = [s for s in services if s != "coordinator"] + [s for s in services if s == "coordinator"]
            logs = "\n".join(f"--- {s}\n{swarm.logs(s)}" for s in order)
            with contextlib.suppress(Exception):
                st = status(swarm.ports["coordinator"])  # type: ignore[attr-defined]
                logs += "\n--- status\n" + json.dumps({k: st.get(k) for k in ("round", "rounds_committed",
                                                                          "rounds_aborted", "members")})[-3000:]
            raise AssertionError(f"{what}: not within {timeout:.0f}s (last: {last!r})\n{logs}")
        time.sleep(every)


def status(port: int) -> dict:
    return fetch_status(f"127.0.0.1:{port}", recent=5, timeout=5.0)


def prometheus(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def metric(text: str, name: str) -> float:
    """The value of an unlabelled metric in Prometheus text format (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# What a build prints when something it downloads is out of reach (the base image's registry,
# or the package index pip installs from): the test then skips, saying so, instead of failing.
UNREACHABLE = ("pinging container registry", "no such host", "dial tcp", "i/o timeout", "TLS handshake timeout",
               "failed to do request", "Temporary failure in name resolution", "Failed to establish a new connection",
               "Network is unreachable")


def unreachable_download(output: str) -> str | None:
    """The skip reason when a failed image build could not download something (its first such
    line), else None (a real build failure: the test fails)."""
    for line in output.splitlines():
        if any(m.lower() in line.lower() for m in UNREACHABLE):
            return f"the image cannot be built here: a download is out of reach ({line.strip()[:300]})"
    return None


def test_an_unreachable_registry_is_a_skip_reason_and_a_build_error_is_not():
    podman = ('Error: creating build container: initializing source docker://python:3.11-slim: pinging container '
              'registry registry-1.docker.io: Get "https://registry-1.docker.io/v2/": dial tcp: lookup '
              'registry-1.docker.io: no such host')
    why = unreachable_download("STEP 1/9: FROM python:3.11-slim\n" + podman)
    assert why is not None and "pinging container registry" in why and why.startswith("the image cannot be built")
    assert unreachable_download("ERROR: failed to solve: process \"/bin/sh -c pip install .\" did not complete "
                                "successfully: exit code: 1\nSyntaxError: invalid syntax") is None


@pytest.fixture(scope="module")
def swarm():
    project = f"shoalci{os.getpid()}"
    engine, why = find_engine(project)
    if engine is None:
        pytest.skip(why)
    image = f"localhost/shoal-compose-test:{project}"
    ports = {"coordinator": _free_port(), "prometheus": _free_port()}
    engine.env = {"SHOAL_IMAGE": image, "SHOAL_COMPOSE_COORDINATOR_PORT": str(ports["coordinator"]),
                  "SHOAL_COMPOSE_PROMETHEUS_PORT": str(ports["prometheus"]),
                  "SHOAL_COMPOSE_ROUNDS": "0",  # run until stopped: the test decides when it ends
                  "SHOAL_COMPOSE_CHECKPOINT_EVERY": "2",  # a checkpoint (and an upload) every 2 rounds
                  "SHOAL_S3_ACCESS_KEY_ID": f"ci-{project}", "SHOAL_S3_SECRET_ACCESS_KEY": f"secret-{os.urandom(8).hex()}"}
    base = "docker" if engine.engine == "docker" else "podman"
    # Host network for the build: pip fetches the dependencies. The stable tag keeps their layer
    # cached for the next run; this run uses its own tag (another tree may build meanwhile).
    built = engine._run([base, "build", "--network", "host", "-f", "deploy/Dockerfile", "-t", image,
                         "-t", "localhost/shoal-compose-test:cache", "."], timeout=1200, check=False)
    if built.returncode != 0:
        why = unreachable_download(built.stdout + built.stderr)
        if why is not None:
            pytest.skip(why)
        raise AssertionError(f"{base} build exited {built.returncode}:\n{built.stdout[-2000:]}\n{built.stderr[-2000:]}")
    try:
        up = engine.compose_cmd("up", "-d", "--no-build", *SERVICES, timeout=600)
        engine.ports = ports  # type: ignore[attr-defined]
        if engine.engine == "podman":  # podman-compose 1.0.x exits 0 when a container could not be made
            missing = [s for s in SERVICES if subprocess.run(["podman", "container", "exists", engine.container(s)],
                                                             capture_output=True, timeout=60).returncode != 0]
            assert not missing, (f"compose up made no container for {missing}:\n{up.stdout[-2000:]}\n"
                                 f"{up.stderr[-2000:]}")
        yield engine
    finally:
        # -t 1: a container still running 1 s after SIGTERM is killed (the test has its figures by
        # then; podman-compose stops the 7 containers one after the other: the default 10 s made
        # the teardown alone take 22 s of the default test run, 5 s still 18 s).
        engine.compose_cmd("down", "-v", "-t", "1", timeout=300, check=False)
        if engine.engine == "podman":  # podman-compose 1.0.x leaves the project's network behind
            subprocess.run(["podman", "network", "rm", "-f", f"{project}_default"], capture_output=True, timeout=60)
        subprocess.run([base, "rmi", image], capture_output=True, timeout=120)  # only untags: :cache stays


@pytest.mark.timeout(2400)
def test_compose_swarm_commits_survives_a_peer_kill_and_a_coordinator_restart(swarm):
    cport, pport = swarm.ports["coordinator"], swarm.ports["prometheus"]

    # Health, as the compose file declares it, run with exec.
    for service in SERVICES:
        check = healthcheck(service)
        wait_until(f"{service} healthy ({shlex.join(check)})",
                   lambda: swarm.service_cmd("exec", service, *check, timeout=60, check=False).returncode == 0,
                   300, swarm)

    # Rounds commit with all four peers, and the host reaches the coordinator on its published port.
    wait_until("4 members and 3 committed rounds",
               lambda: (s := status(cport))["rounds_committed"] >= 3 and len(s["members"]) == 4, 300, swarm)

    # Prometheus scrapes all five targets and sees the coordinator's commits.
    def scraped() -> bool:
        up = prometheus(pport, "up")
        return len(up) == 5 and all(r["value"][1] == "1" for r in up)

    wait_until("Prometheus: up == 1 for the coordinator and the four peers", scraped, 180, swarm)

    # Checkpoints: the elected peer uploads them to the seaweedfs service, with the credentials the
    # compose command's environment gave (a peer lists the bucket with the same ones).
    listing = ["python3", "-c", "import s3fs; print(sum('round-' in p for p in "
               "s3fs.S3FileSystem().ls('shoal-checkpoints/compose')))"]
    wait_until("a checkpoint in s3://shoal-checkpoints/compose (the seaweedfs service)",
               lambda: int(swarm.service_cmd("exec", "peer1", *listing, check=False).stdout.strip() or 0) >= 1,
               300, swarm)
    wait_until("Prometheus: shoal_coordinator_rounds_committed_total > 0",
               lambda: any(float(r["value"][1]) > 0
                           for r in prometheus(pport, "shoal_coordinator_rounds_committed_total")), 180, swarm)

    # kill -9 one peer container: the other three keep committing.
    before = status(cport)
    peer2 = next(m["peer_id"] for m in before["members"] if m["address"] == "peer2:7071")
    swarm.service_cmd("kill", "peer2")
    c0 = status(cport)["rounds_committed"]
    wait_until("3 more committed rounds after peer2 was killed",
               lambda: status(cport)["rounds_committed"] >= c0 + 3, 300, swarm)

    # Started again (same volume, same key): it rejoins as the same member and syncs the state.
    swarm.service_cmd("start", "peer2", check=False)  # a restart policy may have started it already
    wait_until("peer2 a member again with the same peer id",
               lambda: any(m["peer_id"] == peer2 for m in status(cport)["members"]), 300, swarm)
    fetch = ["python3", "-c", "import urllib.request; print(urllib.request.urlopen("
             "'http://127.0.0.1:9100/metrics', timeout=5).read().decode())"]
    wait_until("peer2 synced the committed state (shoal_peer_state_syncs_total >= 1)",
               lambda: metric(swarm.service_cmd("exec", "peer2", *fetch, check=False).stdout,
                              "shoal_peer_state_syncs_total") >= 1, 300, swarm)
    c1 = status(cport)["rounds_committed"]
    wait_until("rounds commit again with peer2 back", lambda: status(cport)["rounds_committed"] >= c1 + 2,
               300, swarm)

    # Stop (SIGTERM) and start the coordinator container: it resumes from its volume.
    last = status(cport)["rounds_committed"]
    swarm.service_cmd("stop", "coordinator", timeout=120)
    swarm.service_cmd("start", "coordinator")
    resumed = wait_until("the restarted coordinator answers", lambda: status(cport), 180, swarm)
    assert resumed["rounds_committed"] >= last, (resumed["rounds_committed"], last)
    wait_until("rounds commit after the coordinator restart",
               lambda: status(cport)["rounds_committed"] >= resumed["rounds_committed"] + 2, 300, swarm)
