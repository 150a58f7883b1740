"""A log a person can read: the throttle writes one line per window and counts the rest, and
attempts are shown as the attempt within their round."""

from __future__ import annotations


from shoal.common.attempts import ATTEMPT_STRIDE, shown_attempt
from shoal.common.throttle import Throttle, more
from shoal.cli.status import render_table


def test_throttle_writes_one_line_per_window_and_counts_the_rest():
    now = [0.0]
    t = Throttle(1.0, clock=lambda: now[0])
    assert t.due() == 0  # the first line is written
    for _ in range(5):
        now[0] += 0.1
        assert t.due() is None  # held back
    now[0] = 1.0
    assert t.due() == 5  # written, saying 5 were held back
    assert more(5) == " (+5 more since the last line)" and more(0) == ""


def test_attempts_are_shown_within_their_round():
    assert [shown_attempt(a) for a in (0, 1, ATTEMPT_STRIDE, ATTEMPT_STRIDE + 2, 7 * ATTEMPT_STRIDE + 4)] == \
        [0, 1, 0, 2, 4]
    s = {"coordinator": "x:1", "epoch": 1, "round": 1, "rounds_committed": 1, "rounds_aborted": 0,
         "run_config": {}, "members": [],
         "rounds": [{"round": 3, "attempt": 2 * ATTEMPT_STRIDE + 1, "status": "committed", "participants": 2,
                     "seconds": 0.5, "train_loss": 0.1, "reason": "", "state_digest": ""}]}
    assert render_table(s).splitlines()[-1].split()[:2] == ["3", "1"]


# A long run by design (the log volume of a busy minute): in the soak tier; the throttle and
# the round lines it relies on are unit-tested above.
