"""Attempt numbers: how they are made unique, and how people see them.

The coordinator numbers the attempts of a round from `ATTEMPT_STRIDE` x incarnation (each start
of the coordinator is a new incarnation), so an attempt id of a restarted coordinator never equals
one its crashed predecessor sent (a stray chunk of the old attempt cannot join the new one). On
the wire and in the events files the ids stay whole; in log lines and tables for people they are
shown as the attempt within the round: 0 for the first try, 1 for the first retry, ...
"""

from __future__ import annotations

ATTEMPT_STRIDE = 1000  # attempts of one round in one incarnation stay below this (max_attempts is small)


def shown_attempt(attempt: int) -> int:
    """The attempt within its round, for people: `attempt` without its incarnation's base."""
    return attempt % ATTEMPT_STRIDE
