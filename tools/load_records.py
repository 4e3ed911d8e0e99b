"""What tools/cb_runner.py and tools/engine_runner.py report of a load run in process: standard library only, so
either runner imports it from its own folder whatever environment runs it (OpenVINO's has no aqua_export)."""

from __future__ import annotations


def report(recs: list[dict], load_s: float) -> dict:
    """recs: each request's tag, start, end and token arrivals -> the runner's JSON: each with its first token, time
    to first token, latency and token count; the load time and the process's peak RSS (VmHWM)."""
    for r in recs:
        r["first"] = r["arrivals"][0] if r["arrivals"] else r["end"]
        r["ttft"], r["latency"], r["tokens"] = r["first"] - r["start"], r["end"] - r["start"], len(r["arrivals"])
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    return {"requests": recs, "load_s": round(load_s, 2), "peak_rss_mb": round(peak)}
