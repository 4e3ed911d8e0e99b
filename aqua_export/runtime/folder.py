"""A built folder's aqua_config.json as a typed, validated, frozen object (one writer: build).

    FolderConfig.from_folder(dir)  -> validated, or one ConfigError line naming the fix
    cfg.write(dir)                 -> aqua_config.json, atomically
    cfg.seal(dir)                  -> the same with the manifest of the folder's other files (a build's last write)
    cfg.verify(dir, checksums)     -> every file the build wrote is there, of its size (and checksum), or one line
    (aqua_config.json holds its own checksum too: an edited file is refused by every command that opens the folder)
    cfg.foreign_files(dir)         -> what else is in the folder (a user's files: never replaced with it)

What the runtimes need is typed (geometry, AQUA settings, the graph contract, context length, the files the
build wrote with their sizes and SHA-256); what the build measured for people to read (tools, stage times and
memory, passes) sits in ``info``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..config import AquaConfig, ConfigError, reject_unknown
from ..contract import DEFAULT_CONTEXT, Contract
from ..outputs import atomic_write_bytes
from ..quantize import WeightFormat

CONFIG_FILE = "aqua_config.json"
KERNELS_PREFIX = "libaqua_ort"  # the native kernels' files (runtime.genai.native_files): optional in a folder
FORMAT_VERSION = 3  # 3: the files manifest
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
    files: dict | None = None  # {name: {"bytes": n, "sha256": hex}} of every file the build wrote but this one
    weights: WeightFormat = WeightFormat()  # float (the contract's dtype) or int4 / int8 blocks (quantize.py)
    format_version: int = FORMAT_VERSION

    @property
    def serving_context(self) -> int:
        """The context a runtime serves this folder at unless told another: the model's length, or DEFAULT_CONTEXT."""
        return self.context_length or DEFAULT_CONTEXT

    def __post_init__(self):
        if self.format_version != FORMAT_VERSION:
            raise ConfigError(f"format_version {self.format_version!r} is not this tool's ({FORMAT_VERSION}): the "
                              "folder was built by another aqua-export")
        if not isinstance(self.model, str):
            raise ConfigError(f"model must be a string, got {self.model!r}")
        if self.context_length is not None:
            _positive("context_length", self.context_length)
        if self.files is not None:
            _check_files(self.files)
        if self.weights.quantized and self.contract.dtype != "float32":
            raise ConfigError(f"{self.weights.name} weights are exported with float32 activations, not {self.contract.dtype}")
        g, c, a = self.geometry, self.contract, self.aqua
        if (c.layers, c.kv_heads) != (g.layers, g.kv_heads):
            raise ConfigError(f"contract ({c.layers} layers, {c.kv_heads} KV heads) disagrees with the geometry "
                              f"({g.layers}, {g.kv_heads})")
        r = a.retained_width(g.head_dim)
        budget_ok = sum(c.widths) + sum(c.value_widths) == 2 * c.layers * r and \
            max(c.widths + c.value_widths) <= g.head_dim
        uniform_k = tuple(a.selected_of(w) for w in c.widths)
        k_ok = c.selected == uniform_k if not a.allocates_k else \
            sum(c.selected) == sum(uniform_k) and all(1 <= k <= w for k, w in zip(c.selected, c.widths))
        k_ok = k_ok and (c.prices is not None) == a.shares_k  # shared k: prices exactly when the settings share
        if not budget_ok or (a.slice_alloc == "uniform" and not c.uniform) or not k_ok:
            raise ConfigError(f"cache widths K^ {list(c.widths)}, V {list(c.value_widths)}, k {list(c.selected)} "
                              "disagree with the AQUA settings")

    @property
    def dtype(self) -> str:
        return self.contract.dtype

    def to_dict(self) -> dict:
        return {"format_version": self.format_version, "model": self.model, "aqua": self.aqua.to_dict(),
                "geometry": dataclasses.asdict(self.geometry), "contract": self.contract.to_dict(),
                "context_length": self.context_length, "fingerprint": self.fingerprint, "info": self.info,
                "files": self.files, "weights": self.weights.to_dict()}

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
                   fingerprint=d.get("fingerprint"), info=d.get("info", {}), files=d.get("files"),
                   weights=WeightFormat.from_dict(d.get("weights", WeightFormat().to_dict())))

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
        if isinstance(data, dict) and CHECKSUM in data:  # folders built before it: nothing to compare
            if data.pop(CHECKSUM) != checksum_of(data):
                raise ConfigError(f"{f} was edited after the build (its content no longer matches its checksum), so it "
                                  "may not describe the graph any more: rebuild the folder (a build's settings are "
                                  "given to the build, not written here)")
        try:
            return cls.from_dict(data)
        except (ConfigError, TypeError, ValueError) as e:
            raise ConfigError(f"{f} is invalid ({e}): rebuild the folder") from None

    def write(self, folder: str | Path) -> None:
        d = self.to_dict()
        atomic_write_bytes(Path(folder) / CONFIG_FILE,
                           json.dumps({**d, CHECKSUM: checksum_of(d)}, indent=1, sort_keys=True).encode())

    def seal(self, folder: str | Path) -> "FolderConfig":
        """The last write of a build: aqua_config.json with the manifest of every other file now in ``folder``."""
        sealed = dataclasses.replace(self, files=record_files(folder))
        sealed.write(folder)
        return sealed

    # ---------------------------------------------------------------- the files the build wrote
    def foreign_files(self, folder: str | Path) -> list[str]:
        """Entries of ``folder`` that the build did not write (sorted)."""
        return foreign_files(folder, self.files)

    def verify(self, folder: str | Path, checksums: bool = False, whole: bool = False) -> int:
        """Every file of the manifest is in ``folder`` with the size the build wrote (and, with checksums, the same
        SHA-256): the bytes verified, or one ConfigError line naming the first file that differs. The native kernels
        may be missing (the runtimes then run the function bodies and say so) unless ``whole`` (`aqua-export check`):
        then the line names every one that is gone."""
        folder = Path(folder)
        if self.files is None:
            raise ConfigError(f"{folder / CONFIG_FILE} lists no files (the folder was not finished by a build): rebuild "
                              "the folder")
        gone = [n for n in sorted(self.files) if n.startswith(KERNELS_PREFIX) and not (folder / n).is_file()]
        if whole and gone:
            raise ConfigError(f"{folder} is incomplete: {', '.join(gone)} (the native kernels) "
                              f"{'is' if len(gone) == 1 else 'are'} missing, so the runtimes would run the custom "
                              "nodes' ONNX function bodies (slower): copy the folder again or rebuild it")
        total = 0
        for name, rec in sorted(self.files.items()):
            f = folder / name
            if name in gone:
                continue  # optional to the runtimes: without them they run the function bodies, in one line
            if not f.is_file():
                raise ConfigError(f"{folder} is damaged: {name} is missing: rebuild the folder")
            size = f.stat().st_size
            if size != rec["bytes"]:
                raise ConfigError(f"{folder} is damaged: {name} has {size} bytes, the build wrote {rec['bytes']}: "
                                  "rebuild the folder")
            if checksums and file_sha256(f) != rec["sha256"]:
                raise ConfigError(f"{folder} is damaged: {name} differs from what the build wrote (SHA-256): rebuild "
                                  "the folder")
            total += size
        return total


def built_files(folder: str | Path) -> dict | None:
    """The manifest of a folder any aqua-export build finished, this version's or an older one's (what a rebuild
    with --force may replace), or None when ``folder`` is not one: aqua_config.json naming the files it wrote."""
    try:
        data = json.loads((Path(folder) / CONFIG_FILE).read_text())
        files = data.get("files")
        _check_files(files)
    except (OSError, ValueError, AttributeError, ConfigError):
        return None
    return files


def foreign_files(folder: str | Path, files: dict | None) -> list[str]:
    """Entries of ``folder`` that a build whose manifest is ``files`` did not write (sorted)."""
    mine = set(files or ()) | {CONFIG_FILE}
    return sorted(p.name for p in Path(folder).iterdir() if p.name not in mine)


CHECKSUM = "sha256"  # aqua_config.json's own: SHA-256 of its other content (checksum_of)


def checksum_of(d: dict) -> str:
    """SHA-256 of a config's content as canonical JSON (sorted keys, no spaces): what it was when written."""
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path, chunk: int = 16 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def record_files(folder: str | Path) -> dict:
    """The manifest of a folder: every plain file but aqua_config.json, with its size and SHA-256."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != CONFIG_FILE}


def _check_files(files) -> None:
    if not isinstance(files, dict):
        raise ConfigError("files must be an object of file name -> {bytes, sha256}")
    for name, rec in files.items():
        if not name or "/" in name or name in (".", "..", CONFIG_FILE):
            raise ConfigError(f"files names {name!r}, which is not a file of the folder")
        if not isinstance(rec, dict) or set(rec) != {"bytes", "sha256"} or isinstance(rec["bytes"], bool) or \
                not isinstance(rec["bytes"], int) or rec["bytes"] < 0 or not isinstance(rec["sha256"], str) or \
                not _SHA256.match(rec["sha256"]):
            raise ConfigError(f"files[{name!r}] must be {{\"bytes\": n, \"sha256\": hex}}, got {rec!r}")
