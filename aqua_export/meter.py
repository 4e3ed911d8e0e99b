"""Time and peak resident memory per pipeline stage, so a build reports what each stage cost.

Linux keeps a process's peak RSS (VmHWM in /proc/self/status) and resets it when "5" is written to
/proc/self/clear_refs: each stage starts from a reset, so its peak is its own, not the run's so far.
Where that file cannot be written, the peak is the process's peak since start (getrusage), stated so.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def cpu_name() -> str:
    """The CPU's model name and the vector instructions the kernels' variants turn on (the benchmark tables' header:
    "AMD EPYC (AVX2, no AVX-512)", "AMD EPYC (AVX-512, VNNI, BF16)"), from /proc/cpuinfo where Linux has it."""
    import platform

    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if not name:
        return platform.processor() or "unknown CPU"
    if "avx512f" in flags:
        isa = ", ".join(["AVX-512"] + [n for f, n in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")) if f in flags])
    elif "avx2" in flags:
        isa = "AVX2, no AVX-512"
    elif flags:
        isa = "no AVX2"
    else:
        return name
    return f"{name} ({isa})"


def _vm_hwm_bytes() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


class StageMeter:
    """meter.start("export") ... meter.start("parity") ... meter.stop(); meter.report() ->
    {"export": {"seconds": 12.3, "peak_rss_gib": 4.1}, ...}."""

    def __init__(self):
        self.stages: dict[str, dict] = {}
        self._name: str | None = None
        self._t0 = 0.0
        self.per_stage = True

    def start(self, name: str) -> None:
        self.stop()
        self.per_stage = _reset_peak() and self.per_stage
        self._name, self._t0 = name, time.perf_counter()

    def stop(self) -> None:
        if self._name is None:
            return
        peak = _vm_hwm_bytes() if self.per_stage else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.stages[self._name] = {"seconds": round(time.perf_counter() - self._t0, 1),
                                   "peak_rss_gib": round(peak / 2**30, 2)}
        self._name = None

    def report(self) -> dict:
        self.stop()
        return {**self.stages, "peak_rss_is": "per stage (VmHWM reset at each stage)" if self.per_stage
                else "since process start (getrusage)"}


def stage_bar(total: int, desc: str, unit: str):
    """A progress bar inside a stage: indented under its stage line, erased when done, redrawn at most every
    2 s (steps take minutes on large models)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"      {desc}", unit=unit, leave=False, mininterval=2.0)
