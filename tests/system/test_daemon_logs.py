"""What the daemons log, with real processes:

- A 3-peer run of 60 s: the coordinator writes at most 200 INFO lines (link reports and plans
  go to debug, "round N committed" at most once a second), and every peer writes one line per
  committed round at INFO, at most once a second (with how many were held back).
- Attempt numbers for people are the attempt within the round (0, 1, ...), also after a restart
  of the coordinator, whose attempt ids on the wire start at 1000 x incarnation.
"""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest

from shoal.cli.status import fetch_status

RUN_SECONDS = 20.0  # 60 s once; the bounds below scale with it


# A long run by design (the log volume of a busy minute): in the soak tier; the throttle and
# the round lines it relies on are unit-tested above.
@pytest.mark.integration
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_a_3_peer_minute_logs_little_and_each_peer_says_its_rounds(procs):
    coord, addr = procs.coordinator("--rounds", "0", "--min-peers", "3", "--initial-peers", "3",
                                    "--inner-steps", "10")
    peers = [procs.start(f"peer-{i}", [sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--coordinator", addr,
                                       "--key", str(procs.workdir / f"p{i}.key"), "--data-shard", str(i),
                                       "--connect-timeout", "60"])
             for i in range(3)]
    end = time.monotonic() + RUN_SECONDS
    while time.monotonic() < end:  # the workload: RUN_SECONDS of rounds (nothing is asserted on speed)
        for p in [coord, *peers]:
            assert p.poll() is None, procs.log(p.name)[-3000:]
        time.sleep(1.0)
    status = fetch_status(addr)
    committed = status["rounds_committed"]
    for p in peers:
        procs.kill(p, signal.SIGKILL)
    procs.kill(coord, signal.SIGTERM)
    procs.wait_exit(coord, 60)
    coordinator_info = [line for line in procs.log("coordinator").splitlines() if " INFO " in line]
    assert committed >= 10, (committed, coordinator_info[-20:])  # the run really ran rounds
    # 200 INFO lines a minute at most (start-up lines included).
    assert len(coordinator_info) <= 200 * RUN_SECONDS / 60, (len(coordinator_info), coordinator_info[:50])
    assert not any("links of" in line for line in coordinator_info)
    for i in range(3):
        lines = [line for line in procs.log(f"peer-{i}").splitlines() if re.search(r" INFO .*round \d+ committed", line)]
        assert lines, procs.log(f"peer-{i}")[-2000:]
        # One line per committed round, rounds held back counted in the next line.
        said = sum(1 + int(m.group(1)) if (m := re.search(r"\(\+(\d+) more", line)) else 1 for line in lines)
        assert said <= committed, (said, committed)
        # At most one a second: the peer lived RUN_SECONDS plus its start and the teardown.
        assert len(lines) <= RUN_SECONDS + 30, len(lines)
        assert said >= committed // 2, (said, committed, lines[-3:])  # it took part in most rounds
