"""ONNX Runtime sessions for a built folder: the providers, the native kernel library (plugins/ort, built by
`make setup`), and the checks made before a folder is loaded to serve (its memory against the machine's)."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

from ..capabilities import KERNELS
from ..config import ConfigError
from .folder import FolderConfig


def providers() -> list[str]:
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]


# Tokens per forward of a long prompt in `aqua-export run` (OrtLM.prefill): the activations' peak shrinks with the
# chunk, and the prompt kernel's attention is the same work either way. 7,936 prompt tokens, forwards of 1,024 /
# 2,048 / all at once (two alternating rounds, an ad-hoc timing of OrtLM.prefill): the dense float32 folder 26.2-26.3
# / 25.5-25.7 / 25.9-26.1 s, the int4 token folder 26.9-27.0 / 26.4-26.8 / 25.7-25.9 s (its products take float32
# activations, whose rate MLAS keeps at any row count). (genai's search.chunk_size does the same at batch 1; genai
# 0.18 refuses it for a batch, so folders leave it unset: docs/reference.md.)
PREFILL_CHUNK = 2048

NATIVE_ENV = "AQUA_ORT_KERNEL"  # path of a libaqua_ort.so to use instead of the installed one
VARIANT_ENV = "AQUA_ORT_ISA"  # force one of the library's instruction-set variants (plugins/ort/loader.cc)
# the variants plugins/ort builds for x86-64, narrowest first (loader.cc; CMakeLists.txt AQUA_VARIANTS)
X86_VARIANTS = ("x86-64-v2", "x86-64-v3", "x86-64-v4")


def native_library() -> Path | None:
    """The native kernels of the custom nodes (plugins/ort): the loader libaqua_ort.so, whose variants lie beside it,
    or None when they were not built."""
    env = os.environ.get(NATIVE_ENV)
    if env:
        if not Path(env).is_file():
            raise ConfigError(f"${NATIVE_ENV}={env} does not exist: unset it or run `make plugin`")
        with open(env, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise ConfigError(f"${NATIVE_ENV}={env} is not a shared library: unset it or point it at a "
                                  "libaqua_ort.so built by `make plugin`")
        return Path(env)
    lib = Path(__file__).parents[1] / "_native" / "libaqua_ort.so"
    return lib if lib.is_file() else None


def native_variant(lib: Path | None = None) -> str:
    """The instruction-set variant of the native kernels that runs on this CPU ("x86-64-v3", ...), or "" when none
    does (or none is built): the function bodies then run. AQUA_ORT_ISA naming one this CPU cannot run: one line."""
    lib = lib or native_library()
    if lib is None:
        return ""
    key = (str(lib), os.environ.get(VARIANT_ENV, ""))
    if key not in _VARIANTS:
        import ctypes

        try:
            handle = ctypes.CDLL(str(lib))
        except OSError as e:  # a library of another machine
            raise ConfigError(f"{lib} cannot be loaded ({e}): rebuild it with `make plugin`, or run with --kernel "
                              "function") from None
        if hasattr(handle, "AquaOrtVariant"):
            handle.AquaOrtVariant.restype = ctypes.c_char_p
            _VARIANTS[key] = handle.AquaOrtVariant().decode()
        else:  # a library of one build, without variants (before the loader): $AQUA_ORT_KERNEL may name one
            _VARIANTS[key] = "single"
    name = _VARIANTS[key]
    if name.startswith("!"):
        raise ConfigError(f"{name[1:]} (${VARIANT_ENV})")
    return name


_VARIANTS: dict = {}  # (library, AQUA_ORT_ISA) -> its answer


def prompt_bf16_runs(lib: Path | None = None) -> bool:
    """Whether the native kernels compute a prompt's attention products in bfloat16 here when a folder asks
    (settings/precision.py): the library says (its loader's AquaOrtPromptBf16: the variant it registers on this CPU
    has bfloat16 products and the CPU runs them, AVX512_BF16); elsewhere they compute in float32."""
    lib = lib or native_library()
    variant = native_variant(lib) if lib is not None else ""
    if not variant:
        return False
    import ctypes

    handle = ctypes.CDLL(str(lib))
    if not hasattr(handle, "AquaOrtPromptBf16"):  # a library from before the question (AVX-512 only had them)
        return variant == "x86-64-v4" and "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    return bool(handle.AquaOrtPromptBf16())


@contextlib.contextmanager
def forced_variant(name: str | None):
    """Within: the native kernels' variant `name` (AQUA_ORT_ISA), for the sessions made and runs forked meanwhile;
    None leaves the loader's own choice. Sessions keep the variant registered when they were made."""
    old = os.environ.get(VARIANT_ENV)
    if name is not None:
        os.environ[VARIANT_ENV] = name
    try:
        yield
    finally:
        if name is not None:
            if old is None:
                os.environ.pop(VARIANT_ENV, None)
            else:
                os.environ[VARIANT_ENV] = old


def variants_here(lib: Path | None = None) -> list[str]:
    """The kernels' instruction-set variants this CPU runs, narrowest first ([] without the kernels or on a CPU whose
    library has one variant): what `python -m tools prompt` / `prefill` / `serve --variants` measure side by side."""
    lib = lib or native_library()
    if lib is None:
        return []
    out = []
    for name in X86_VARIANTS:
        with forced_variant(name):
            try:
                if native_variant(lib) == name:
                    out.append(name)
            except ConfigError:  # this CPU cannot run it, or its file is missing
                pass
    return out


def peak_gflops(lib: Path | None = None, seconds: float = 0.3) -> float:
    """One thread's multiply-add rate, GFLOP/s, on the vectors of the variant the loader registers here (AQUA_ORT_ISA
    forces one): the rate its register tiles are measured against (plugins/ort/simd/simd.h peak_gflops); 0 when
    none runs or the library predates the question."""
    lib = lib or native_library()
    if lib is None or not native_variant(lib):
        return 0.0
    import ctypes

    handle = ctypes.CDLL(str(lib))
    if not hasattr(handle, "AquaOrtPeakGflops"):
        return 0.0
    handle.AquaOrtPeakGflops.restype = ctypes.c_double
    handle.AquaOrtPeakGflops.argtypes = [ctypes.c_double]
    return float(handle.AquaOrtPeakGflops(seconds))


_SAID: set = set()  # the one-line notices already printed by this process


def say_once(text: str) -> None:
    """A notice on stderr, once per process (a fallback a user should know of, not an error)."""
    import sys

    if text not in _SAID:
        _SAID.add(text)
        print(text, file=sys.stderr, flush=True)


def available_memory() -> int:
    """Bytes the kernel says a new process can take now without swapping (/proc/meminfo's MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def check_serving(cfg: FolderConfig, folder, batch: int, slots: int) -> None:
    """Before a folder is loaded to serve ``batch`` sequences of up to ``slots`` tokens: a float16 folder needs a GPU
    (ONNX Runtime's CPU provider keeps a float32 copy of every float16 weight it multiplies: twice the folder), and
    the weights plus the cache must fit the memory available now; otherwise one line with the numbers."""
    if cfg.dtype == "float16" and "CUDAExecutionProvider" not in providers():
        raise ConfigError(f"{folder} is float16, the GPU format: on a CPU ONNX Runtime keeps a float32 copy of every "
                          "float16 weight (twice the folder in memory, no faster); serve a build with --weights int4 "
                          "(or --dtype float32) on CPU")
    weights = sum(rec["bytes"] for name, rec in (cfg.files or {}).items() if name.startswith("model.onnx"))
    cache = cfg.contract.cache_bytes(batch, slots)
    free = available_memory()
    if weights + cache > free:
        raise ConfigError(f"{folder} needs {weights / 2**30:.2f} GiB of weights and {cache / 2**30:.2f} GiB of cache for "
                          f"{batch} x {slots} tokens, and {free / 2**30:.2f} GiB of memory is available: serve fewer or "
                          "shorter sequences, or a smaller folder (--weights int4)")


def default_kernel(dtype: str) -> str:
    """"native" for float32 models when the native kernels are built and one of their variants runs on this CPU,
    else "function". float16: ONNX Runtime's CPU provider runs the body's MatMul in float32 behind inserted casts and
    keeps the scores in float32 into the softmax, while a float16 kernel must round them to float16 (less accurate),
    so the body is used."""
    if dtype != "float32" or native_library() is None:
        return "function"
    if not native_variant():
        say_once(no_variant_line(native_library()))
        return "function"
    return "native"


def no_variant_line(lib: Path) -> str:
    return (f"aqua-export: no variant of the native kernels beside {lib} runs on this CPU (they need at least "
            "x86-64-v2: SSE4.2 and POPCNT): the custom nodes run their ONNX function bodies (slower)")


def kernel_line(kernel: str, asked: str, dtype: str) -> str:
    """The one line `aqua-export run` says of the path ONNX Runtime takes for the custom nodes: ``kernel`` as chosen
    ("native" / "function") from ``asked`` (--kernel) for a folder of ``dtype``. A fallback reads as the notice
    default_kernel printed for it, so a run says it once."""
    lib = native_library()
    if kernel == "native":
        return f"aqua-export: ONNX Runtime runs the custom nodes on the native kernels ({native_variant(lib)}: {lib})"
    if asked == "function":
        why = "--kernel function"
    elif dtype != "float32":
        why = f"a {dtype} folder: ONNX Runtime's CPU provider runs their products in float32 (runtime.default_kernel)"
    elif lib is None:
        why = "the native kernels are not built: `make plugin`, or install the wheel"
    else:
        return no_variant_line(lib)
    return f"aqua-export: ONNX Runtime runs the custom nodes' ONNX function bodies ({why})"


def make_session(model: str | Path | bytes, threads: int = 0, kernel: str = "auto", spin: bool = True,
                 lean: bool = False, profile: str | None = None):
    """An ORT session (CUDA when onnxruntime-gpu and a GPU are present, else CPU).

    kernel: "native" registers the native kernels of the custom nodes (error when not built), "function" runs the
    model's portable function body, "auto" is native when built. spin=False stops the intra-op threads
    from busy-waiting between runs (benchmarks holding several sessions, so they do not steal cores).
    lean=True (parity's low-memory float16 variant): Cast nodes on weights stay run-time work instead of
    ONNX Runtime storing their float32 results, and no memory arena, so each cast weight is freed after its
    node (an arena keeps its peak, which here grows towards the float32 model, for the session's life).
    profile: a path prefix for ONNX Runtime's profile of every node run (a JSON file, written by the session's
    end_profiling(); bench --profile reads it).
    """
    import onnxruntime as ort

    if kernel not in KERNELS:
        raise ConfigError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if lean:
        so.enable_cpu_mem_arena = False
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    if kernel == "auto":
        kernel = default_kernel("float32")
    lib = native_library() if kernel == "native" else None
    if kernel == "native" and lib is None:
        raise ConfigError("the native kernels are not built: run `make plugin` (or use kernel='function')")
    if lib is not None and not native_variant(lib):
        raise ConfigError(f"no variant of the native kernels beside {lib} runs on this CPU (they need at least "
                          "x86-64-v2: SSE4.2 and POPCNT): run with --kernel function")
    if lib is not None:
        try:
            so.register_custom_ops_library(str(lib))
        except Exception as e:  # ORT's own exception types: a library for another CPU or ONNX Runtime
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"ONNX Runtime cannot load the native kernels {lib} ({first}): rebuild them with `make "
                              "plugin`, or run with --kernel function") from None
    src = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(src, sess_options=so, providers=providers(),
                                    disabled_optimizers=["ConstantFolding"] if lean else None)
    except Exception as e:  # ORT raises its own exception types (InvalidProtobuf, Fail, NoSuchFile, ...)
        if isinstance(model, bytes):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{model} cannot be loaded by ONNX Runtime ({type(e).__name__}: {first[:200]}): the file is "
                          "corrupt, truncated or not this folder's model; rebuild the folder") from None
