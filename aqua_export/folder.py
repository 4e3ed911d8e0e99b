"""A built folder's aqua_config.json as a typed, validated, frozen object (one writer: build).

    FolderConfig.from_folder(dir)  -> validated, or one ConfigError line naming the fix
    cfg.write(dir)                 -> aqua_config.json, atomically

What the runtimes need is typed (geometry, AQUA settings, the graph contract, context length); what the
build measured for people to read (tools, stage times and memory, passes) sits in ``info``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .config import AquaConfig, ConfigError, reject_unknown
from .contract import Contract

CONFIG_FILE = "aqua_config.json"
FORMAT_VERSION = 2


def _positive(where: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{where} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class Geometry:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _positive(f"geometry.{f.name}", getattr(self, f.name))


@dataclass(frozen=True)
class FolderConfig:
    model: str
    aqua: AquaConfig
    geometry: Geometry
    contract: Contract
    context_length: int | None = None
    fingerprint: dict | None = None
    info: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.format_version != FORMAT_VERSION:
            raise ConfigError(f"format_version {self.format_version!r} is not this tool's ({FORMAT_VERSION}): the "
                              "folder was built by another aqua-export")
        if not isinstance(self.model, str):
            raise ConfigError(f"model must be a string, got {self.model!r}")
        if self.context_length is not None:
            _positive("context_length", self.context_length)
        g, c, a = self.geometry, self.contract, self.aqua
        if (c.layers, c.kv_heads) != (g.layers, g.kv_heads):
            raise ConfigError(f"contract ({c.layers} layers, {c.kv_heads} KV heads) disagrees with the geometry "
                              f"({g.layers}, {g.kv_heads})")
        r = a.retained_width(g.head_dim)
        budget_ok = sum(c.widths) + sum(c.value_widths) == 2 * c.layers * r and \
            max(c.widths + c.value_widths) <= g.head_dim
        if not budget_ok or (a.slice_alloc == "uniform" and not c.uniform) or \
                c.selected != tuple(a.selected_of(w) for w in c.widths):
            raise ConfigError(f"cache widths K^ {list(c.widths)}, V {list(c.value_widths)}, k {list(c.selected)} "
                              "disagree with the AQUA settings")

    @property
    def dtype(self) -> str:
        return self.contract.dtype

    def to_dict(self) -> dict:
        return {"format_version": self.format_version, "model": self.model, "aqua": self.aqua.to_dict(),
                "geometry": dataclasses.asdict(self.geometry), "contract": self.contract.to_dict(),
                "context_length": self.context_length, "fingerprint": self.fingerprint, "info": self.info}

    @classmethod
    def from_dict(cls, d) -> "FolderConfig":
        if not isinstance(d, dict):
            raise ConfigError("not a JSON object")
        if d.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"format_version {d.get('format_version')!r} is not this tool's ({FORMAT_VERSION})")
        reject_unknown(cls, d)
        for key in ("aqua", "geometry", "contract"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"{key!r} missing or not an object")
        try:
            geometry = Geometry(**d["geometry"])
        except TypeError as e:
            raise ConfigError(f"geometry: {e}") from None
        if not isinstance(d.get("info", {}), dict):
            raise ConfigError("info must be an object")
        return cls(model=d.get("model"), aqua=AquaConfig.from_dict(d["aqua"]), geometry=geometry,
                   contract=Contract.from_dict(d["contract"]), context_length=d.get("context_length"),
                   fingerprint=d.get("fingerprint"), info=d.get("info", {}))

    @classmethod
    def from_folder(cls, folder: str | Path) -> "FolderConfig":
        folder = Path(folder)
        f = folder / CONFIG_FILE
        if not f.is_file():
            raise ConfigError(f"{folder} is not an aqua-export folder (no {CONFIG_FILE}): build one with "
                              "`aqua-export --model ...`")
        try:
            data = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"{f} is corrupt (not JSON): rebuild the folder") from None
        try:
            return cls.from_dict(data)
        except (ConfigError, TypeError, ValueError) as e:
            raise ConfigError(f"{f} is invalid ({e}): rebuild the folder") from None

    def write(self, folder: str | Path) -> None:
        from .safetensors_io import atomic_write_bytes

        atomic_write_bytes(Path(folder) / CONFIG_FILE, json.dumps(self.to_dict(), indent=1, sort_keys=True).encode())
