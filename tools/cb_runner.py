"""OpenVINO GenAI's continuous-batching pipeline under a load, in process (no HTTP: OpenVINO's own OpenAI server,
OVMS, does not install from PyPI). Runs in OpenVINO's virtual environment (tools/folders.py's ENVS): only the
standard library, numpy and openvino_genai. tools/bench_serve.py calls it.

    python cb_runner.py FOLDER LOAD.json  -> one JSON line on stdout: {"requests": [...], "load_s", "peak_rss_mb"}

LOAD.json: {"chats": [[system or null, user], ...], "new": N, "at_once": C, "threads": T (0: none given),
"max_seqs": S, "prefix_caching": bool, "precision": "" or "f32" (INFERENCE_PRECISION_HINT: its default is bf16
on a CPU with avx512_bf16 or AMX)}. Each chat goes through the folder's chat template; greedy, N tokens each
(min_new_tokens = N, as ignore_eos makes ours). At most C requests are in the pipeline at once; a finished one lets
the next in before the next step. Each request's record: its tag, start, first token, end, each token's arrival,
its token count (what tools/bench_serve.py's summary reads).
"""

from __future__ import annotations

import json
import sys
import time

from load_records import report  # tools/, beside this script (run as a script, from any environment)


def run(folder: str, load: dict) -> dict:
    import openvino_genai as ovg

    t0 = time.perf_counter()
    sc = ovg.SchedulerConfig()
    sc.max_num_seqs = load["max_seqs"]
    sc.cache_size = 2  # GB of KV blocks: 16 chats of 2k tokens of this model need about 0.4
    sc.enable_prefix_caching = load["prefix_caching"]
    props = {"INFERENCE_NUM_THREADS": load["threads"]} if load["threads"] else {}
    if load.get("precision"):
        props["INFERENCE_PRECISION_HINT"] = load["precision"]
    pipe = ovg.ContinuousBatchingPipeline(folder, sc, "CPU", props)
    tok = pipe.get_tokenizer()
    cfg = ovg.GenerationConfig(max_new_tokens=load["new"], min_new_tokens=load["new"], do_sample=False)
    texts = [tok.apply_chat_template(([{"role": "system", "content": s}] if s else []) +
                                     [{"role": "user", "content": u}], add_generation_prompt=True)
             for s, u in load["chats"]]
    load_s = time.perf_counter() - t0
    recs, live, nxt = [], {}, 0
    running = ovg.GenerationStatus.RUNNING
    while nxt < len(texts) or live:
        while nxt < len(texts) and len(live) < load["at_once"]:
            recs.append({"tag": nxt, "start": time.perf_counter(), "arrivals": []})
            live[nxt] = pipe.add_request(nxt, texts[nxt], cfg)
            nxt += 1
        pipe.step()
        now = time.perf_counter()
        for i, h in list(live.items()):
            status = h.get_status()
            if h.can_read():
                for out in h.read().values():
                    recs[i]["arrivals"] += [now] * len(out.generated_ids)
            if status != running:
                recs[i]["end"] = now
                del live[i]
    return report(recs, load_s)


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], json.loads(open(sys.argv[2]).read()))))
