"""Replicas of `aqua-export serve` behind HAProxy (docs/deploy/haproxy.cfg, the file users copy), on the loopback:
load through the proxy, one replica killed with `kill -9` mid-load and restarted as a supervisor would, and what
the clients saw.

    python -m tools replicas [--requests 200] [--at-once 16] [--threads 1]

Two replicas of the int4 token folder (build/prefill/ours-tokens-int4-f16, made as `python -m tools prefill` makes
it), each given --threads (1: the two share this 2-core machine as two machines would each have their own);
200 streamed chat requests of 50-400 prose tokens + 32 generated, 16 at a time. Replica 1 is killed once a quarter
of them are answered and started again at once on its port. Writes benchmarks/replicas.json and replicas.md.
HAProxy: Debian's package unpacked under build/haproxy (HAPROXY_DEBS; `make test` fetches it too).
tests/test_replicas.py runs the same at tiny size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from tools.folders import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "deploy" / "haproxy.cfg"
HAPROXY_DIR = ROOT / "build" / "haproxy"
HAPROXY = HAPROXY_DIR / "usr" / "sbin" / "haproxy"
# HAProxy and what it links beyond a base Debian system (bookworm's packages: plugins/fetch_deb.sh)
HAPROXY_DEBS = "haproxy,liblua5.3-0,libopentracing-c-wrapper0,libopentracing1"


def fetch_haproxy() -> Path:
    subprocess.run(["bash", str(ROOT / "plugins" / "fetch_deb.sh"), HAPROXY_DEBS, str(HAPROXY_DIR), "bookworm"],
                   check=True)
    return HAPROXY


def _get(url: str, timeout: float = 2) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _wait(ok, what: str, proc: subprocess.Popen, log: Path, seconds: float = 300) -> float:
    """Polls ok() until true; the seconds it took. Refuses in one line when proc exits or time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): see {log}")
        try:
            if ok():
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready in {seconds:.0f} s: see {log}")


class Replica:
    """`aqua-export serve FOLDER` on 127.0.0.1:port (args: serve's options), restartable on the same port."""

    def __init__(self, folder: Path, args: list[str], logs: Path, name: str):
        self.folder, self.args, self.port, self.name = folder, args, free_port(), name
        self.log, self.starts = logs / f"{name}.log", 0
        self.proc = None

    def start(self) -> float:
        """Starts it; seconds until /health says ok."""
        self.starts += 1
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "aqua_export", "serve", str(self.folder), "--port",
                                          str(self.port), *self.args], stdout=log, stderr=subprocess.STDOUT)
        return _wait(lambda: json.loads(_get(f"http://127.0.0.1:{self.port}/health"))["status"] == "ok",
                     f"replica {self.name}", self.proc, self.log)

    def metric(self, name: str) -> float:
        """A metric of /metrics, summed over its labels."""
        text = _get(f"http://127.0.0.1:{self.port}/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Proxy:
    """HAProxy on docs/deploy/haproxy.cfg: clients at 127.0.0.1:port, the replicas behind it."""

    def __init__(self, replicas: list[Replica], logs: Path, haproxy: Path = HAPROXY):
        if len(replicas) != 2:
            raise ValueError("docs/deploy/haproxy.cfg names two replicas")
        self.port, self.log = free_port(), logs / "haproxy.log"
        env = dict(os.environ, AQUA_PROXY_BIND=f"127.0.0.1:{self.port}",
                   LD_LIBRARY_PATH=str(haproxy.parents[1] / "lib" / "x86_64-linux-gnu"),
                   **{f"AQUA_REPLICA_{i + 1}": f"127.0.0.1:{r.port}" for i, r in enumerate(replicas)})
        with open(self.log, "w") as log:  # -db: in the foreground, its log on stderr
            self.proc = subprocess.Popen([str(haproxy), "-db", "-f", str(CONFIG)], stdout=log,
                                         stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        _wait(lambda: json.loads(_get(self.url + "/health"))["status"] == "ok", "haproxy", self.proc, self.log, 30)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def chat(url: str, model: str, prompt: str, new: int, on_replica=lambda name, change: None) -> dict:
    """One streamed greedy chat through url: answered only when a finish reason came (a stream cut short by a
    killed replica ends without one); the replica that answered (the proxy's X-Replica header), if any did.
    on_replica(name, +1 / -1): called when that replica's stream starts and when it ends."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    t0, first, finish, pieces, replica = time.perf_counter(), None, None, 0, None
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=new, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        replica = raw.headers.get("x-replica")
        on_replica(replica, 1)
        try:
            for ch in raw.parse():
                if ch.choices and ch.choices[0].delta.content:
                    first = first or time.perf_counter()
                    pieces += 1
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
        finally:
            on_replica(replica, -1)
        error = None
    except Exception as e:  # what the client saw of a killed replica
        error = type(e).__name__
        response = getattr(e, "response", None)  # the proxy's own 502 names the replica it came from too
        replica = replica or (response.headers.get("x-replica") if response is not None else None)
    end = time.perf_counter()
    return {"answered": finish is not None, "error": error, "replica": replica, "start": t0,
            "ttft": (first or end) - t0, "latency": end - t0, "pieces": pieces}


def given(replica: Replica) -> bool:
    """Whether a replica has been given any request since it started (waiting, prefilling, running or finished)."""
    return sum(replica.metric(m) for m in ("aqua_queue_depth", "aqua_prefilling", "aqua_running_sequences",
                                            "aqua_requests_total")) > 0


def unanswered_on(log: Path, server: str, before: float) -> int:
    """Requests in HAProxy's log (option httplog) that it sent to `server`, accepted before the wall-clock time
    `before`, and ended without any response to the client (status -1: the server died with the request, e.g. SD)."""
    n = 0
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"\[(\d+/\w+/\d+:\d+:\d+:\d+\.\d+)\] \S+ \S+/(\S+) \S+ (-?\d+) ", line)
        # HAProxy writes its local time, as datetime reads a naive one
        if m and m[2] == server and m[3] == "-1" and \
                datetime.strptime(m[1], "%d/%b/%Y:%H:%M:%S.%f").timestamp() < before:
            n += 1
    return n


def fault_run(folder: Path, prompts: list[str], new: int, at_once: int, serve_args: list[str], logs: Path,
              kill_after: int, haproxy: Path = HAPROXY, back_within: float = 120) -> dict:
    """Two replicas of folder behind the proxy; prompts streamed through it at_once at a time; replica 1 killed with
    SIGKILL once kill_after are answered and restarted on its port. Counts what was answered, what failed and
    where (lost_elsewhere: failures not streaming from the killed replica when it died: the proxy's to prevent),
    and when the proxy sent the restarted one work."""
    if kill_after >= len(prompts):
        raise ValueError("kill_after must leave requests to run after the kill")
    logs.mkdir(parents=True, exist_ok=True)
    reps = [Replica(folder, serve_args, logs, f"replica{i + 1}") for i in range(2)]
    for r in reps:
        r.start()
    proxy = Proxy(reps, logs, haproxy)
    done, out, lock, streaming = [0], {}, threading.Lock(), {"replica1": 0, "replica2": 0}

    def on_replica(name, change):
        with lock:
            streaming[name] = streaming.get(name, 0) + change

    def one(p):
        res = chat(proxy.url, folder.name, p, new, on_replica)
        with lock:
            done[0] += res["answered"]
        return res

    def killer():
        # under load: once kill_after are answered and replica 1 is streaming (else the next request to it)
        while done[0] < kill_after or not streaming["replica1"]:
            time.sleep(0.002)
        victim = reps[0]
        victim.stop(signal.SIGKILL)
        # reaped, so its sockets are closed: until then the kernel still queued connections on its port for it,
        # and a request HAProxy sent there in those milliseconds went down with it
        out["gone"], out["gone_wall"] = time.perf_counter(), time.time()
        out["killed_at_answered"] = done[0]
        out["restart_ready_s"] = round(victim.start(), 2)
        out["restarted_at"] = time.perf_counter()
        # back in the proxy: the first request it is given (waiting, prefilling, running or done), while the load runs
        while not out.get("load_done") and time.perf_counter() - out["restarted_at"] < back_within:
            if given(victim):
                out["back_s"] = time.perf_counter() - out["restarted_at"]
                return
            time.sleep(0.02)

    try:
        t0 = time.perf_counter()
        watcher = threading.Thread(target=killer)
        watcher.start()
        with ThreadPoolExecutor(at_once) as pool:
            res = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
        out["load_done"] = True
        watcher.join()
        # the load ended before the proxy gave the restarted replica work: more requests, one at a time, until it does
        extra, t_back = 0, out.get("back_s")
        while t_back is None and time.perf_counter() - out["restarted_at"] < back_within:
            extra += chat(proxy.url, folder.name, prompts[extra % len(prompts)], 2)["answered"]
            if given(reps[0]):
                t_back = time.perf_counter() - out["restarted_at"]
        served_after = reps[0].metric("aqua_requests_total")
    finally:
        proxy.stop()
        for r in reps:
            r.stop()
    answered = [r for r in res if r["answered"]]
    failed = [r for r in res if not r["answered"]]
    # held by the killed replica: sent to it (its X-Replica) and started before it was gone; or given no response at
    # all (no header to name a replica) where HAProxy's log says it had sent that many to the killed one and got
    # nothing
    held = [r for r in failed if r["replica"] == "replica1" and r["start"] < out["gone"]]
    unheard = [r for r in failed if r["replica"] is None and r["start"] < out["gone"]]
    held += unheard[:unanswered_on(proxy.log, "replica1", out["gone_wall"])]
    ttft = sorted(r["ttft"] for r in answered)
    return {"requests": len(prompts), "at_once": at_once, "answered": len(answered),
            "failed": len(failed), "errors": sorted({r["error"] for r in res if r["error"]}),
            "lost_with_killed": len(held), "lost_elsewhere": len(failed) - len(held),
            "by_replica": {n: sum(r["replica"] == n for r in answered) for n in ("replica1", "replica2")},
            "killed_at_answered": out["killed_at_answered"],
            "restart_ready_s": out["restart_ready_s"],
            "taken_back_s": None if t_back is None else round(t_back, 2), "extra_requests": extra,
            "served_by_restarted": int(served_after), "wall_s": round(wall, 2),
            "pieces_per_s": round(sum(r["pieces"] for r in res) / wall, 2),
            "ttft_p50_s": round(ttft[len(ttft) // 2], 3) if ttft else None,
            "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 3) if ttft else None}


def idle_starts(folder: Path, args: list[str], logs: Path, n: int = 3) -> list[float]:
    """Seconds from starting `aqua-export serve FOLDER` to /health's ok on an otherwise idle machine, n starts (the
    folder in the page cache after the first): Python's imports, the model loaded into ONNX Runtime (weights read,
    int4 blocks packed, the graph optimized), the port bound."""
    logs.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        r = Replica(folder, args, logs, f"idle{i}")
        try:
            out.append(round(r.start(), 2))
        finally:
            r.stop()
    return out


def write(res: dict) -> None:
    from tools.harness import BENCHMARKS, table, written_by

    (BENCHMARKS / "replicas.json").write_text(json.dumps(res, indent=2) + "\n")
    r = res["fault"]
    lines = ["# Two replicas behind HAProxy, one killed mid-load", "", written_by("replicas"), "",
             f"docs/deploy/haproxy.cfg on the loopback; two `aqua-export serve` replicas of {res['folder']} "
             f"({' '.join(res['serve_args'])}); {r['requests']} streamed chats ({res['prompt_tokens']} prose tokens "
             f"+ {res['new']} generated), {r['at_once']} at a time through the proxy. Replica 1 killed with SIGKILL "
             f"after {r['killed_at_answered']} were answered, then started again on its port.", "",
             *table(["requests", "answered", "cut short on the killed replica", "lost elsewhere",
                     "answered by replica 1 / 2", "restart ready s", "back in the proxy s", "TTFT p50 / p95 s",
                     "wall s", "tokens/s"],
                    [[r["requests"], r["answered"], r["lost_with_killed"], r["lost_elsewhere"],
                      f"{r['by_replica']['replica1']} / {r['by_replica']['replica2']}", r["restart_ready_s"],
                      r["taken_back_s"], f"{r['ttft_p50_s']} / {r['ttft_p95_s']}", r["wall_s"],
                      r["pieces_per_s"]]]), "",
             "Cut short: requests the killed replica held (streams it had started cannot be replayed; one it had "
             "taken and reset gets the proxy's 502, which the openai client retries by itself). Lost elsewhere: any other request not answered (none is the aim: a request the dead replica "
             "refused or dropped before answering is retried on the other). Back in the proxy: from the restart's "
             "first healthy answer to the first request the proxy sent it.", "",
             f"Restart ready: from starting the replica again to its first healthy /health, while the other replica "
             f"served the load on the same {os.cpu_count()} cores. On the idle machine a start took "
             f"{' / '.join(f'{x:.2f}' for x in res.get('idle_start_s', []))} s ({len(res.get('idle_start_s', []))} "
             "starts, the folder in the page cache): Python's imports, the model loaded into ONNX Runtime (weights "
             "read, int4 blocks packed, the graph optimized) and the port bound; a machine under load divides the "
             "cores among them, and a first start after a reboot reads the folder from disk too.", ""]
    (BENCHMARKS / "replicas.md").write_text("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools replicas", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--at-once", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="each replica's --threads")
    a = ap.parse_args(argv)
    import random

    from tools.folders import FOLDERS, Text, make

    if a.requests < 8 or a.at_once < 1:
        raise SystemExit("--requests takes 8 or more, --at-once 1 or more")
    fetch_haproxy()
    folder = FOLDERS["ours-tokens-int4"]
    make("ours:" + folder.name.removeprefix("ours-"))
    text, rnd = Text(), random.Random(1)
    prompts = [text.take(rnd.randint(50, 400)) for _ in range(a.requests)]
    args = ["--threads", str(a.threads), "--context", "2048", "--max-seqs", "16", "--queue", "256"]
    res = {"folder": folder.name, "serve_args": args, "prompt_tokens": "50-400", "new": 32,
           "idle_start_s": idle_starts(folder, args, ROOT / "build" / "replicas"),
           "fault": fault_run(folder, prompts, 32, a.at_once, args, ROOT / "build" / "replicas",
                              kill_after=a.requests // 4)}
    print(json.dumps(res), flush=True)
    write(res)


if __name__ == "__main__":
    main()
