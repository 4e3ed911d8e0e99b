"""The calibration artifact (projection.safetensors): written by calibrate, read by every stage that applies AQUA.

Per layer i (docs/design.md, Calibration), float32:
    layers.{i}.P        [Hkv, d, d]   eigenvectors of the q/k stack's second moment, columns by energy
    layers.{i}.P_v      [Hkv, d, d]   the same for the values
    layers.{i}.energy   [Hkv, d]      mean squared coordinate of the q/k stack in P's basis
    layers.{i}.energy_v [Hkv, d]      same for values in P_v's basis
    layers.{i}.key_rms  [Hkv, d]      rms of k^ per coordinate (keys only)
  optional, for --slice-alloc measured (slice_costs.measure_costs; metadata "slice_widths" lists the widths):
    layers.{i}.slice_cost [2, n]      KL of the next-token distribution with only layer i's K^ (row 0) or V
                                      (row 1) cut to each width
  optional, for --k-alloc measured (slice_costs.measure_select_costs; metadata "select_rule", "select_widths",
  "select_head_widths"), all three or the set is not used:
    layers.{i}.select_head_cost [Hkv, m]    the same KL with only KV head h of layer i selecting k of its
                                            coordinates (its g query rows), each k of select_head_widths
    layers.{i}.select_head_energy [Hkv, m]  the mean squared selection score those rows drop at each k (dense run):
                                            with select_head_cost, the head's price (allocate.head_prices)
    layers.{i}.select_cost [n]              the KL with only layer i selecting k, its heads sharing k at those
                                            prices (ops.rules, pooled), each k of select_widths
metadata: format_version, fingerprint (models.fingerprint, JSON), corpus name and SHA-256, tokens, seq_len, seed, tool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ConfigError
from .models import fingerprint
from .safetensors_io import save as save_safetensors

FORMAT_VERSION = "1"
TENSORS = ("P", "P_v", "energy", "energy_v", "key_rms")  # per layer, in every artifact
# optional: widths key, rows (an int, "kv_heads", or None: one row)
COSTS = {"slice_cost": ("slice_widths", 2), "select_cost": ("select_widths", None),
         "select_head_cost": ("select_head_widths", "kv_heads"),
         "select_head_energy": ("select_head_widths", "kv_heads")}


def write(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    save_safetensors(Path(path), tensors, metadata)


@dataclass(frozen=True)
class Projection:
    """A loaded artifact. P[l]: [Hkv, d, d]; energy[l]: [Hkv, d]; same for the value side."""

    P: tuple[torch.Tensor, ...]
    P_v: tuple[torch.Tensor, ...]
    energy: tuple[torch.Tensor, ...]
    energy_v: tuple[torch.Tensor, ...]
    key_rms: tuple[torch.Tensor, ...]
    metadata: dict
    slice_cost: tuple[torch.Tensor, ...] | None = None  # [2, n] per layer at metadata["slice_widths"]
    select_cost: tuple[torch.Tensor, ...] | None = None  # [n] per layer at metadata["select_widths"]
    select_head_cost: tuple[torch.Tensor, ...] | None = None  # [Hkv, m] per layer at metadata["select_head_widths"]
    select_head_energy: tuple[torch.Tensor, ...] | None = None  # [Hkv, m] per layer, the same widths

    @property
    def fingerprint(self) -> dict:
        return json.loads(self.metadata["fingerprint"])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The artifact's tensors keyed by layer, as ``write`` takes them (measured costs included)."""
        kinds = TENSORS + tuple(k for k in COSTS if getattr(self, k) is not None)
        return {f"layers.{i}.{k}": getattr(self, k)[i] for i in range(len(self.P)) for k in kinds}

    def has_select_costs(self, selection: str) -> bool:
        """Whether the artifact holds selection costs measured under ``selection`` (--k-alloc measured's)."""
        return None not in (self.select_cost, self.select_head_cost, self.select_head_energy) and \
            self.metadata.get("select_rule") == selection

    def check_config(self, cfg) -> None:
        """What a model's config alone decides (its architecture and shapes), before its weights load."""
        from .models import architecture_of, config_geometry

        self._compare({k: v for k, v in self.fingerprint.items() if k != "attention_sha256"},
                      {"architecture": architecture_of(cfg).model_type, **config_geometry(cfg)})

    def check_model(self, model) -> None:
        self._compare(self.fingerprint, fingerprint(model))

    @staticmethod
    def _compare(mine: dict, theirs: dict) -> None:
        if mine != theirs:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ConfigError(
                f"projection was calibrated on another model (differs in {', '.join(diff)}): "
                "recalibrate with `aqua-export calibrate --model ...` on this model"
            )


def is_projection(path: str | Path) -> bool:
    """Whether ``path`` is a projection artifact this tool wrote (its safetensors header alone is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return False
    return meta.get("format_version") == FORMAT_VERSION and "fingerprint" in meta and \
        meta.get("tool", "").startswith("aqua-export")


def load_projection(path: str | Path) -> Projection:
    """Read and validate an artifact; any problem is one ConfigError line naming the file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"projection file {path} does not exist: create it with `aqua-export calibrate`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"projection file {path} is corrupt or not safetensors ({str(e).splitlines()[0]})") from None
    if meta.get("format_version") != FORMAT_VERSION or "fingerprint" not in meta:
        raise ConfigError(f"projection file {path} is not an aqua-export projection (format {meta.get('format_version')!r})")
    try:
        fp = json.loads(meta["fingerprint"])
        n_layers, hkv, d = int(fp["layers"]), int(fp["kv_heads"]), int(fp["head_dim"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"projection file {path} has a corrupt fingerprint") from None
    out: dict[str, list] = {k: [] for k in TENSORS}
    for i in range(n_layers):
        for k, shape in (("P", (hkv, d, d)), ("P_v", (hkv, d, d)), ("energy", (hkv, d)),
                         ("energy_v", (hkv, d)), ("key_rms", (hkv, d))):
            t = tensors.get(f"layers.{i}.{k}")
            if t is None or tuple(t.shape) != shape or t.dtype != torch.float32:
                raise ConfigError(f"projection file {path} is corrupt: layers.{i}.{k} missing or not float32 {list(shape)}")
            if not torch.isfinite(t).all():
                raise ConfigError(f"projection file {path} is corrupt: layers.{i}.{k} has non-finite values")
            out[k].append(t)
        for k in ("P", "P_v"):
            p = out[k][-1]
            err = (p.transpose(-1, -2) @ p - torch.eye(d)).abs().max().item()
            if err > 1e-4:
                raise ConfigError(f"projection file {path} is corrupt: layers.{i}.{k} is not orthogonal (error {err:.1e})")
    return Projection(**{k: tuple(v) for k, v in out.items()}, metadata=meta,
                      **{k: _costs(path, tensors, meta, n_layers, hkv, d, k) for k in COSTS})


def _costs(path, tensors: dict, meta: dict, n_layers: int, hkv: int, d: int, kind: str):
    """Optional measured costs (``kind`` of COSTS): all layers or none, at the metadata's widths (each in [1, d))."""
    key, rows = COSTS[kind]
    what = kind.split("_")[0]
    have = [f"layers.{i}.{kind}" in tensors for i in range(n_layers)]
    if not any(have):
        return None
    rows = hkv if rows == "kv_heads" else rows
    try:
        widths = [int(w) for w in meta[key].split(",")]
    except (KeyError, ValueError):
        raise ConfigError(f"projection file {path} is corrupt: {what} costs without valid {key}") from None
    if not all(have) or sorted(set(widths)) != widths or not all(0 < w < d for w in widths) or len(widths) < 2:
        raise ConfigError(f"projection file {path} is corrupt: {what} costs missing for some layers or bad widths")
    out = tuple(tensors[f"layers.{i}.{kind}"] for i in range(n_layers))
    shape = (len(widths),) if rows is None else (rows, len(widths))
    if any(tuple(t.shape) != shape or not torch.isfinite(t).all() for t in out):
        raise ConfigError(f"projection file {path} is corrupt: a {kind} is not {list(shape)} finite values")
    return out
