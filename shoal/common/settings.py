"""How a setting is declared: a dataclass field carrying its help text and how it is spelled.

Responsible for the one shape of a setting's metadata that `shoal.config` reads to parse files,
environment variables and flags and to generate docs/configuration.md. A section of settings is a
frozen dataclass whose fields are made with `setting`; a section may live next to the code that
reads it (`shoal.coordinator.settings.RoundSettings`) and is reused as it is by `shoal.config`.
Not responsible for parsing or validating values (`shoal.config`).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any, help: str, *, flag: str | None = None, choices: tuple[str, ...] | None = None,
            negate: bool = False) -> Any:
    """A dataclass field with the metadata the parser and the docs need.

    help: one line for `--help` and the docs. flag: the command-line flag (default:
    --key-with-dashes). choices: the values allowed. negate: a boolean whose flag turns it off
    (e.g. `--no-progress` for `progress = true`).
    """
    meta = {"help": help, "flag": flag, "choices": choices, "negate": negate}
    return field(default=default, metadata=meta)
