"""Typed, frozen configuration of the AQUA variants, round-tripping through JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from .ops import spec

CONFIG_VERSION = 3  # 3: k_alloc; 2: token selection (token_ratio, token_budget, ...); 1 and 2 still read
SELECTIONS = tuple(spec.SELECTIONS)  # the rule names; what each scores: ops.rules
SLICE_ALLOCS = ("uniform", "energy", "measured")  # how AQUA-Memory spreads its width budget over layers (allocate.py)
K_ALLOCS = ("uniform", "energy", "measured")  # how the selection budget k spreads over layers (allocate.py)
TOKEN_SINK, TOKEN_WINDOW = 16, 64  # token selection's forced tokens unless asked (AquaConfig says why these)
MAX_TOKENS = 1 << 24  # the largest token count a setting may name: past any model's context
# how each rule scores coordinate i of q^ before taking the top k (ops.rules.selection_score is the definition):
#   shared: one index set per KV group (the sum of the score over its g query heads), so a kernel reads exactly
#           k of K^'s r rows per group instead of the union of g selections
#   weighted: |q^_i| * rms(k^_i); exported by folding rms into P (q^ * w, k^ / w: same scores, see export)


class ConfigError(ValueError):
    """Bad user input; the message is one line that names the fix."""


def reject_unknown(cls, data: dict, what: str = "") -> None:
    """One ConfigError line naming the keys of ``data`` that are not fields of the dataclass ``cls``."""
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(f"unknown {what}field(s): {', '.join(unknown)}")


def _ratio(name: str, value: object, lo: float, hi: float, lo_open: bool, hi_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    lo_bad = v <= lo if lo_open else v < lo
    hi_bad = v >= hi if hi_open else v > hi
    if lo_bad or hi_bad:
        lb = "(" if lo_open else "["
        hb = ")" if hi_open else "]"
        raise ConfigError(f"{name}={value!r} is out of range: use a value in {lb}{lo:g}, {hi:g}{hb}")
    return v


@dataclass(frozen=True)
class AquaConfig:
    """What AQUA does at inference time.

    k_ratio:     fraction of the retained width r whose coordinates score each query, in (0, 1].
    slice_ratio: AQUA-Memory, fraction of P's trailing columns dropped before caching K and V, in [0, 1).
    h2o_ratio:   AQUA-H2O, fraction of tokens kept in the cache, in (0, 1]; 1 = no eviction.
    selection:   how coordinates are chosen: 'magnitude' (the paper: top-k of |q^|), 'static'
                 (LoKi-style: the first k principal coordinates) or 'weighted' (top-k of
                 |q^_i| * rms(k^_i), the expected contribution of coordinate i to the score);
                 'group' / 'group-weighted' share one selection across the query heads of a GQA group
                 (top-k of the group's summed |q^_i|, or summed |q^_i| * rms(k^_i)).
    slice_alloc: how AQUA-Memory's budget (slice_ratio of every layer's width, on average) is spread over the
                 layers: 'uniform' (the paper: every layer drops the same share), 'energy' (water-filling on
                 the calibrated spectra) or 'measured' (on each layer's measured cost of slicing; allocate.py).
    k_alloc:     how the selection width is spread: 'uniform' (every query row selects k_ratio of its layer's
                 width), 'energy' (over layers by water-filling on the calibrated spectra; a layer's heads share its
                 k per token, by their selection scores) or 'measured' (over layers by each layer's measured cost of
                 a narrower selection; the heads share the layer's k at prices from each KV head's measured cost).
                 The layers' k sum to uniform's, and every token's rows select as many coordinates in all
                 (allocate.py).
    token_ratio: token selection, share of the visible tokens a decode step attends, in (0, 1]; 1 = all. The
                 approximate scores (the k selected coordinates) choose pages of tokens (ops.rules), which get exact
                 attention (all r coordinates); nothing is evicted, and a prompt's rows attend every token exactly.
    token_budget: instead of the ratio, a fixed number of tokens per decode step (0 = by the ratio).
    token_sink / token_window: the first / last visible tokens every decode step keeps (their pages).
    """

    k_ratio: float = 1.0
    slice_ratio: float = 0.0
    h2o_ratio: float = 1.0
    selection: str = "magnitude"
    slice_alloc: str = "uniform"
    k_alloc: str = "uniform"
    token_ratio: float = 1.0
    token_budget: int = 0
    token_sink: int = TOKEN_SINK  # one page: the attention-sink tokens models keep looking at (StreamingLLM keeps 4)
    token_window: int = TOKEN_WINDOW  # four pages of the most recent tokens: the local context the next one leans on
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_ratio", _ratio("k_ratio", self.k_ratio, 0.0, 1.0, True, False))
        object.__setattr__(self, "slice_ratio", _ratio("slice_ratio", self.slice_ratio, 0.0, 1.0, False, True))
        object.__setattr__(self, "h2o_ratio", _ratio("h2o_ratio", self.h2o_ratio, 0.0, 1.0, True, False))
        if self.selection not in SELECTIONS:
            raise ConfigError(f"selection={self.selection!r} is unknown: use one of {', '.join(SELECTIONS)}")
        if self.slice_alloc not in SLICE_ALLOCS:
            raise ConfigError(f"slice_alloc={self.slice_alloc!r} is unknown: use one of {', '.join(SLICE_ALLOCS)}")
        if self.k_alloc not in K_ALLOCS:
            raise ConfigError(f"k_alloc={self.k_alloc!r} is unknown: use one of {', '.join(K_ALLOCS)}")
        object.__setattr__(self, "token_ratio", _ratio("token_ratio", self.token_ratio, 0.0, 1.0, True, False))
        for name in ("token_budget", "token_sink", "token_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name}={v!r} must be a whole number >= 0")
            if v > MAX_TOKENS:
                raise ConfigError(f"{name}={v} is past any context this tool serves ({MAX_TOKENS} tokens): give the "
                                  "tokens a decode step reads")
        if not self.selects_tokens and (self.token_sink, self.token_window) != (TOKEN_SINK, TOKEN_WINDOW):
            raise ConfigError("token_sink / token_window are token selection's: give --token-budget or --token-ratio "
                              "too, or drop them")
        if self.token_budget and self.token_ratio < 1:
            raise ConfigError("--token-ratio and --token-budget both choose how many tokens a step reads: give one")
        if self.selects_tokens and self.evicts:
            raise ConfigError("token selection reads a share of a cache that keeps every token, and AQUA-H2O evicts "
                              "tokens from it: use --token-ratio / --token-budget or --h2o-ratio, not both")
        if self.version not in (1, 2, CONFIG_VERSION):
            raise ConfigError(f"AquaConfig version {self.version} is not supported (this tool writes {CONFIG_VERSION})")
        object.__setattr__(self, "version", CONFIG_VERSION)  # 1 and 2: this version without the newer fields

    # Widths (docs/design.md): r = d - round(slice_ratio * d), k = round(k_ratio * r), at least 1.
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

    @property
    def shared_selection(self) -> bool:
        return self.selection.startswith("group")

    @property
    def weighted_selection(self) -> bool:
        return self.selection.endswith("weighted")

    @property
    def evicts(self) -> bool:
        """AQUA-H2O: the cache keeps a share of the tokens."""
        return self.h2o_ratio < 1.0

    @property
    def selects_tokens(self) -> bool:
        """Token selection: a decode step reads the chosen pages of the cache, not all of it."""
        return self.token_ratio < 1.0 or self.token_budget > 0

    @property
    def allocates_k(self) -> bool:
        """The layers' k are spread by k_alloc rather than each round(k_ratio r_l) (k_ratio 1 leaves nothing to
        spread)."""
        return self.k_alloc != "uniform" and self.k_ratio < 1.0

    @property
    def shares_k(self) -> bool:
        """A layer's heads share its k per token (allocate.head_prices): an allocation under a rule that reads the
        query, without H2O."""
        return self.allocates_k and self.selection != "static" and self.h2o_ratio == 1.0

    @property
    def is_dense(self) -> bool:
        return self.k_ratio == 1.0 and self.slice_ratio == 0.0 and self.h2o_ratio == 1.0 and not self.selects_tokens

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "AquaConfig":
        if not isinstance(data, dict):
            raise ConfigError("an AQUA config must be a JSON object")
        reject_unknown(cls, data, "AQUA config ")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "AquaConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"AQUA config is not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(data)
