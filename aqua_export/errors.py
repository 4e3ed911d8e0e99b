"""The one error type of bad user input, and the check every JSON reader makes."""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    """Bad user input; the message is one line that names the fix."""


def reject_unknown(cls, data: dict, what: str = "") -> None:
    """One ConfigError line naming the keys of ``data`` that are not fields of the dataclass ``cls``."""
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(f"unknown {what}field(s): {', '.join(unknown)}")
