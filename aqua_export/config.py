"""AquaConfig: what AQUA does at inference time, typed, frozen and round-tripping through JSON. Its fields are the
settings of the mechanisms in settings/ (one module each: fields, defaults, ranges, help, checks, node attributes);
this module composes them and adds the widths every stage derives from them."""

from __future__ import annotations

import dataclasses
import json

from . import settings
from .errors import ConfigError, reject_unknown

__all__ = ["CONFIG_VERSION", "AquaConfig", "ConfigError", "reject_unknown"]

CONFIG_VERSION = 6  # 6: sparse prefill's estimate defaults (stride 8, k' = r); 5: prompt_precision; 4: sparse
# prefill (prefill_*); 3: k_alloc; 2: token selection; 1-5 read


class _Config:
    """AquaConfig's behaviour; its fields (settings.SETTINGS, then version) are made below from the mechanisms.

    The widths (docs/design.md): r = d - round(slice_ratio * d), k = round(k_ratio * r), at least 1.
    """

    def __post_init__(self) -> None:
        for name, s in settings.SETTINGS.items():
            object.__setattr__(self, name, s.check(getattr(self, name)))
        for m in settings.MECHANISMS:
            m.check(self)
        if self.version not in (1, 2, 3, 4, 5, CONFIG_VERSION):
            raise ConfigError(f"AquaConfig version {self.version} is not supported (this tool writes {CONFIG_VERSION})")
        object.__setattr__(self, "version", CONFIG_VERSION)  # 1-5: this version without the newer fields

    def retained_width(self, head_dim: int) -> int:
        r = head_dim - round(self.slice_ratio * head_dim)
        if r < 1:
            raise ConfigError(f"slice_ratio={self.slice_ratio} leaves no coordinate of head_dim={head_dim}: lower it")
        return r

    def selected_width(self, head_dim: int) -> int:
        return self.selected_of(self.retained_width(head_dim))

    def selected_of(self, r: int) -> int:
        """k for a layer that caches r coordinates."""
        return max(1, min(r, round(self.k_ratio * r)))

    # the mechanisms' aliases (settings.Mechanism.aliases: shared_selection, evicts, selects_tokens, shares_k,
    # sparse_prefill, prompt_bf16, ...) are set on this class below

    @property
    def on(self) -> tuple[str, ...]:
        """The mechanisms this config turns on (settings.MECHANISMS' names)."""
        return tuple(m.name for m in settings.MECHANISMS if m.on(self))

    @property
    def is_dense(self) -> bool:
        """Exact attention over every token: no mechanism that changes what a step computes is on (the prompt's
        bfloat16 products round, but approximate nothing: a dense folder needs no projection for them)."""
        return not any(m.approximates and m.on(self) for m in settings.MECHANISMS)

    def require_projection(self, given: bool, fix: str, spell: str = "flag") -> None:
        """One ConfigError line when this config approximates (not is_dense) and no projection is given: it names
        the settings that ask for one, as the caller's user gave them (spell "flag": --k-ratio 0.5; "arg":
        k_ratio=0.5), then ``fix``."""
        if given or self.is_dense:
            return
        on = [s for m in settings.MECHANISMS if m.approximates and m.on(self)
              for s in m.settings
              if getattr(self, s.name) != s.default]
        shown = {s.name: f"{v:g}" if isinstance(v := getattr(self, s.name), float) else str(v) for s in on}
        named = ", ".join(f"{s.flag} {shown[s.name]}" if spell == "flag" else f"{s.name}={shown[s.name]}" for s in on)
        raise ConfigError(f"{named} need{'s' if len(on) == 1 else ''} {fix}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> AquaConfig:
        if not isinstance(data, dict):
            raise ConfigError("an AQUA config must be a JSON object")
        reject_unknown(cls, data, "AQUA config ")
        version = data.get("version", 1)
        if isinstance(version, int) and version < 6:  # another type is refused below
            data = settings.prefill.upgrade(data)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> AquaConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"AQUA config is not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(data)


AquaConfig = dataclasses.make_dataclass(
    "AquaConfig", [(s.name, s.kind, dataclasses.field(default=s.default)) for s in settings.SETTINGS.values()]
    + [("version", int, dataclasses.field(default=CONFIG_VERSION))], bases=(_Config,), frozen=True)
for _m in settings.MECHANISMS:  # a mechanism's names for what a config does (AquaConfig.selects_tokens, ...)
    for _alias, _fn in _m.aliases.items():
        setattr(AquaConfig, _alias, property(_fn))
AquaConfig.__module__ = __name__  # what pickle and repr name (make_dataclass cannot be told before Python 3.12)
AquaConfig.__doc__ = "What AQUA does at inference time; one field per setting of settings.MECHANISMS:\n\n" + "\n".join(
    f"    {s.name}: {s.help}" for s in settings.SETTINGS.values())
