"""What a setting and a mechanism are: each mechanism module (selection.py, memory.py, ...) declares one
``Mechanism`` with its ``Setting``s, and everything else (AquaConfig's fields, the CLI flags, lm-eval's model
arguments, docs/cli.md's table) is derived from those declarations."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ConfigError

MAX_TOKENS = 1 << 24  # the largest token count a setting may name: past any model's context


@dataclass(frozen=True)
class Setting:
    """One field of AquaConfig. kind float: a number in the interval (lo, hi) with open/closed ends; kind int: a
    whole number in [lo, hi] of whole (at most [0, MAX_TOKENS]); kind str: one of choices. help is one line, without
    the default."""

    name: str
    kind: type
    default: object
    help: str
    choices: tuple[str, ...] = ()
    interval: tuple[float, float, bool, bool] = (0.0, 1.0, False, False)  # lo, hi, lo open, hi open
    whole: tuple[int, int] = (0, MAX_TOKENS)  # kind int: lo, hi

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def domain(self) -> str:
        """The accepted values, as docs and errors spell them."""
        if self.kind is str:
            return ", ".join(self.choices)
        if self.kind is int:
            return f"whole number in [{self.whole[0]}, {self.whole[1]}]"
        lo, hi, lo_open, hi_open = self.interval
        return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def check(self, value, said: str | None = None):
        """The value as AquaConfig stores it (a float for kind float), or one ConfigError line naming the fix. said:
        how the user gave it, as the message names it (default ``name=value``, as a config or lm-eval's model_args
        spell it; the CLI names its flag: add_to)."""
        said = said or f"{self.name}={value!r}"
        if self.kind is str:
            if value not in self.choices:
                raise ConfigError(f"{said} is unknown: use one of {', '.join(self.choices)}")
            return value
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{said} is not a whole number: use a {self.domain()}")
            if value > MAX_TOKENS:
                raise ConfigError(f"{said} is past any context this tool serves ({MAX_TOKENS} tokens): give the tokens "
                                  "a decode step reads")
            if not self.whole[0] <= value <= self.whole[1]:
                raise ConfigError(f"{said} is out of range: use a {self.domain()}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{said} is not a number: use a value in {self.domain()}")
        v = float(value)
        lo, hi, lo_open, hi_open = self.interval
        if math.isnan(v) or (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
            raise ConfigError(f"{said} is out of range: use a value in {self.domain()}")
        return v

    def parse(self, text, said: str | None = None):
        """A value given as text (lm-eval's model_args, a query string, a flag) -> the setting's type; check()
        judges it."""
        if not isinstance(text, str) or self.kind is str:
            return text
        try:
            return self.kind(text)
        except ValueError:
            said = said or f"{self.name}={text!r}"
            if self.kind is int:
                raise ConfigError(f"{said} is not a whole number: use a {self.domain()}") from None
            raise ConfigError(f"{said} is not a number: use a value in {self.domain()}") from None

    def from_flag(self, text: str):
        """argparse's type for this setting's flag: the value parsed and checked, or argparse's error naming the flag
        (argument --prefill-threshold: 2 is out of range: use a value in (0, 1])."""
        import argparse

        try:
            return self.check(self.parse(text, said=repr(text) if self.kind is str else text), said=text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def add_to(self, parser, default=None) -> None:
        """This setting as a command-line option of an argparse parser (its value checked as it is parsed)."""
        parser.add_argument(self.flag, type=self.from_flag, default=self.default if default is None else default,
                            choices=self.choices or None, help=f"{self.help} (default %(default)s)")


LIVE = "live"  # Probe.source: the runtime loop's live tokens, not a graph output


@dataclass(frozen=True)
class Probe:
    """What parity (parity/harness.py) checks of a mechanism that chooses at run time: ONNX Runtime's choice is
    recorded, the reference replays it (parity.probe.ReplayProbe), and every place the reference's own rule would
    have chosen otherwise must be a float near-tie.

    gate: the parity result's key, ReplayProbe's keyword for the recorded choice and its ``<gate>_summary`` reader;
    says: the gate's name in the README's parity lines; source: where ONNX Runtime's choice is read, the debug graph's
    output named so (export.rewrites.selection_outputs) or ``live`` (the loop's record of the live tokens after each
    token: runtime.lm.Probe, a prompt then runs token by token); prompt: (cfg, requested, limit) -> the parity
    prompt's length that exercises the choice within limit tokens; unexercised: (cfg, n, context) -> the line
    refusing a config whose choice an n-token prompt (the longest in the model's context) never exercises, or None;
    cache_top1: (top-1 agreement, logit tie) a narrow cache must keep with a float32 one when the mechanism is on
    (its choices move with the rounding), or None for the cache type's own bar."""

    gate: str
    says: str
    source: str  # LIVE, or an output name
    prompt: Callable[[object, int, int], int] = lambda cfg, n, limit: n
    unexercised: Callable[[object, int, object], str | None] = lambda cfg, n, context: None
    cache_top1: tuple[float, float] | None = None


@dataclass(frozen=True)
class Mechanism:
    """One mechanism of AQUA, the whole of what the Python outside its op knows of it: its settings, whether a config
    turns it on, the checks that span its settings and the others', the attributes it gives the attention node (a
    dict merged into the node's attributes), and the rows it adds to the capability table (capabilities.py)."""

    name: str
    summary: str
    settings: tuple[Setting, ...]
    on: Callable[[object], bool]
    check: Callable[[object], None] = lambda cfg: None
    node_attrs: Callable[[object], dict] = field(default=lambda cfg: {})
    # the parts of a default folder name (build.default_out) this mechanism adds when on: every setting it has that
    # changes the graph, once it differs from its default
    name_parts: Callable[[object], list] = field(default=lambda cfg: [])
    # on, it changes what a step computes: the config is not dense (AquaConfig.is_dense) and needs a projection;
    # False for one that only spreads k or rounds the products
    approximates: bool = True
    # AquaConfig's properties it names (AquaConfig.selects_tokens: tokens.selects), {property: cfg -> value}
    aliases: dict = field(default_factory=dict)
    # the capability table's rows it asks for (capabilities.Features' fields), {row: cfg -> bool}
    features: dict = field(default_factory=dict)
    # {(row, backend): the one line refusing it there}; notes: {(row, backend): the cell where it runs differently}
    refusals: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    # {node attribute: its value where the mechanism does nothing} (export.rewrites.set_k: the graph at k = r; parity's
    # run at k = r also sets this mechanism's settings to their defaults)
    neutral: dict = field(default_factory=dict)
    # what parity checks of the choices it makes at run time (Probe), or None
    probe: Probe | None = None
