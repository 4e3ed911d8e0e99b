"""AQUA's settings, one module per mechanism (selection, memory, k_alloc, h2o, tokens, prefill, precision). Each
owns its fields, defaults, ranges, one-line help, the checks across fields and the attention node's attributes it
contributes, and its rows of the capability table (what it asks of a backend, and the line refusing it there).
AquaConfig (config.py: its fields and aliases, is_dense), the CLI flags, lm-eval's model arguments, the capability
table (capabilities.py), export.rewrites.set_k and parity's per-mode gates and runs (Mechanism.probe) are derived
from MECHANISMS, as is docs/cli.md from them. A new
mechanism is a module here and one entry below (or register(), before aqua_export.config is imported:
tests/test_one_home.py adds a mode that way)."""

from __future__ import annotations

from . import h2o, k_alloc, memory, precision, prefill, selection, tokens
from .base import MAX_TOKENS, Mechanism, Setting

MECHANISMS: tuple[Mechanism, ...] = (selection.MECHANISM, memory.MECHANISM, k_alloc.MECHANISM, h2o.MECHANISM,
                                     tokens.MECHANISM, prefill.MECHANISM, precision.MECHANISM)
SETTINGS: dict[str, Setting] = {s.name: s for m in MECHANISMS for s in m.settings}

__all__ = ["MAX_TOKENS", "MECHANISMS", "SETTINGS", "Mechanism", "Setting", "add_arguments", "from_args",
           "from_text", "name_parts", "node_attrs", "register", "table"]


def register(mechanism: Mechanism) -> None:
    """One more mechanism, declared outside this package: what a module here and its entry in MECHANISMS do. It must
    come before aqua_export.config and aqua_export.capabilities are imported (they derive their fields then)."""
    global MECHANISMS
    import sys

    if "aqua_export.config" in sys.modules:
        raise RuntimeError("settings.register after aqua_export.config was imported: AquaConfig has its fields")
    MECHANISMS = (*MECHANISMS, mechanism)
    SETTINGS.update({s.name: s for s in mechanism.settings})


def add_arguments(parser) -> None:
    """Every setting as a command-line option of ``parser``."""
    for s in SETTINGS.values():
        s.add_to(parser)


def from_args(namespace) -> dict:
    """The settings of parsed command-line options (add_arguments'), as AquaConfig's keyword arguments."""
    return {name: getattr(namespace, name) for name in SETTINGS}


def from_text(values: dict) -> dict:
    """Settings given as text (lm-eval's model_args) -> AquaConfig's keyword arguments; unknown names are the
    caller's to refuse."""
    return {name: SETTINGS[name].parse(v) for name, v in values.items()}


def node_attrs(cfg) -> dict:
    """The attention node's attributes the mechanisms contribute (the graph's shapes, k among them, come from
    the contract)."""
    out: dict = {}
    for m in MECHANISMS:
        out.update(m.node_attrs(cfg))
    return out


def name_parts(cfg) -> list[str]:
    """The parts of a default folder name the mechanisms add (in MECHANISMS' order)."""
    return [part for m in MECHANISMS for part in m.name_parts(cfg)]


def table() -> str:
    """docs/cli.md's settings table (markdown): mechanism, flag, lm-eval argument, default, values."""
    rows = ["| mechanism | flag | lm-eval model_args | default | values |", "|---|---|---|---|---|"]
    for m in MECHANISMS:
        for s in m.settings:
            rows.append(f"| {m.name} | `{s.flag}` | `{s.name}` | `{s.default}` | {s.domain()} |")
    return "\n".join(rows)
