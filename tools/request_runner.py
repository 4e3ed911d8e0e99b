"""One request as a user makes it, in a fresh process of whichever environment the engine lives in: a prompt of
token ids, prefilled through the engine's own API, then greedy tokens after it. Needs only the standard library,
numpy and the engine's package, so the peers run from their own virtual environments (tools/folders.py).

    python request_runner.py ENGINE PATH PROMPT.npy BATCH CHUNK NEW THREADS  -> one JSON line on stdout:
    {"ttft_s", "decode_tokens_per_s", "e2e_s", "load_s", "peak_rss_mb", "loaded_rss_mb", "first_tokens"}

ENGINE: genai (onnxruntime-genai, any folder: ours or its model builder's; DIR@no-arena turns its CPU arena off),
aqua (`aqua-export run`'s runtime: a long prompt in forwards of runtime.session.PREFILL_CHUNK tokens),
openvino (OpenVINO GenAI's LLMPipeline on an optimum-intel folder; PATH may end in @f32 for float32 inference
precision, or @xattention for its XAttention sparse prefill: threshold 0.8, blocks of 64, stride 8), llamacpp (llama-cpp-python on a GGUF: f16 KV cache, or q8_0 for GGUF@q8_0, flash attention).
THREADS 0 sets no thread count at all: the engine's own default, what a user who sets nothing gets.
PROMPT.npy holds [T] int64 ids, repeated over the batch. CHUNK 0 appends the prompt in one call; otherwise in calls of CHUNK tokens (genai, batch 1).
Time to first token runs from handing over the prompt to the first generated id; decode tokens/s counts the
NEW - 1 tokens after it per sequence (batch x that over the time). Peak RSS is the process's VmHWM, loading included;
loaded RSS the resident memory once the model is loaded, before the prompt.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def _genai(path, prompt, chunk, new, threads, clock):
    import onnxruntime_genai as og

    path, _, option = path.partition("@")  # DIR@no-arena: the CPU arena off (what the folder's config turns on)
    session = {**({"intra_op_num_threads": threads} if threads else {}),
               **({"enable_cpu_mem_arena": False} if option == "no-arena" else {})}
    config = og.Config(path)
    if session:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": session}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    b, t = prompt.shape
    params.set_search_options(max_length=t + new, batch_size=b, past_present_share_buffer=True)
    gen = og.Generator(model, params)
    clock("load")
    step = chunk or t
    for s in range(0, t, step):
        gen.append_tokens(prompt[:, s:s + step])
    out = []
    for _ in range(new):
        gen.generate_next_token()
        out.append(np.asarray(gen.get_next_tokens()).reshape(b))
        clock("token")
    return out


def _aqua(path, prompt, chunk, new, threads, clock):
    from aqua_export.runtime.hosts import open_lm
    from aqua_export.runtime.sampling import SamplingConfig

    b, t = prompt.shape
    lm = open_lm(path, "aqua", threads, serving=(b, t + new))
    clock("load")
    out = []
    lm.generate(prompt, np.ones_like(prompt), SamplingConfig(max_new_tokens=new),
                on_token=lambda step, ids: (out.append(np.asarray(ids).reshape(b)), clock("token")))
    return out


def _openvino(path, prompt, chunk, new, threads, clock):
    import openvino as ov
    import openvino_genai as ovg

    path, _, option = path.partition("@")
    props = {"INFERENCE_NUM_THREADS": threads} if threads else {}
    if option == "xattention":  # its sparse prefill: antidiagonal block scores, OpenVINO's documented settings
        sc = ovg.SchedulerConfig()
        sc.use_sparse_attention = True
        sc.sparse_attention_config = ovg.SparseAttentionConfig(
            mode=ovg.SparseAttentionMode.XATTENTION, xattention_threshold=0.8, xattention_block_size=64,
            xattention_stride=8)
        props["scheduler_config"] = sc
    elif option:
        props["INFERENCE_PRECISION_HINT"] = option
    pipe = ovg.LLMPipeline(path, "CPU", **props)
    clock("load")
    config = ovg.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    out = []

    class Stream(ovg.StreamerBase):
        def write(self, token):
            ids = token if isinstance(token, list) else [token]
            for i in ids:
                out.append(np.array([i]))
                clock("token")
            return ovg.StreamingStatus.RUNNING

        def end(self):
            pass

    ids = ov.Tensor(prompt)
    inputs = ovg.TokenizedInputs(ids, ov.Tensor(np.ones_like(prompt)))
    if prompt.shape[0] == 1:
        pipe.generate(inputs, config, Stream())
    else:  # a streamer takes one sequence: time the batch as one request (first token = the whole batch's)
        res = pipe.generate(inputs, config)
        m = res.perf_metrics
        clock("token", m.get_ttft().mean / 1e3)
        out = [np.asarray(x)[:1] for x in np.asarray(res.tokens).T]
    return out


def _llamacpp(path, prompt, chunk, new, threads, clock):
    import llama_cpp

    b, t = prompt.shape
    if b != 1:
        raise SystemExit("llamacpp: llama-cpp-python's Llama serves one sequence: batch 1 only")
    path, _, cache = path.partition("@")  # GGUF@q8_0: a q8_0 KV cache (-ctk / -ctv q8_0), else float16
    kv = {"type_k": llama_cpp.GGML_TYPE_Q8_0, "type_v": llama_cpp.GGML_TYPE_Q8_0} if cache == "q8_0" else {}
    counts = {"n_threads": threads, "n_threads_batch": threads} if threads else {}
    llm = llama_cpp.Llama(model_path=path, n_ctx=t + new + 8, **counts,
                          n_batch=chunk or 2048, n_ubatch=512, flash_attn=True, verbose=False, logits_all=False, **kv)
    clock("load")
    out = []
    for tok in llm.generate(prompt[0].tolist(), temp=0.0, top_k=1, reset=True):
        out.append(np.array([tok]))
        clock("token")
        if len(out) == new:
            break
    return out


ENGINES = {"genai": _genai, "aqua": _aqua, "openvino": _openvino, "llamacpp": _llamacpp}


def main(argv) -> dict:
    engine, path, prompt_file, batch, chunk, new, threads = argv
    batch, chunk, new, threads = int(batch), int(chunk), int(new), int(threads)
    prompt = np.tile(np.load(prompt_file).astype(np.int64)[None], (batch, 1))
    marks = {"start": time.perf_counter()}

    def clock(what, at=None):  # "load", then "token" per generated token: the first one is the one timed
        now = time.perf_counter()
        if what == "load":
            marks["load"], marks["load_rss"] = now, _status_mb("VmRSS")
        elif "first" not in marks:  # at: an engine's own first-token time (s after the request)
            marks["first"] = now if at is None else marks["load"] + at

    out = ENGINES[engine](path, prompt, chunk, new, threads, clock)
    end = time.perf_counter()
    if len(out) < new:
        raise SystemExit(f"{engine}: {len(out)} tokens generated of {new}")
    first = marks["first"] - marks["load"]
    e2e = end - marks["load"]
    return {"ttft_s": first, "decode_tokens_per_s": batch * (new - 1) / (e2e - first), "e2e_s": e2e,
            "load_s": marks["load"] - marks["start"], "peak_rss_mb": _status_mb("VmHWM"),
            "loaded_rss_mb": marks["load_rss"],
            "first_tokens": [int(np.asarray(x).reshape(-1)[0]) for x in out[:8]]}


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # llama.cpp's OpenMP threads: spinning collapses when shared
    print(json.dumps(main(sys.argv[1:])))
