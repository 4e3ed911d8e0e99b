"""`aqua-export serve`'s engine (serving.Engine) under a load, in process: no HTTP, no client, as tools/cb_runner.py
drives OpenVINO's continuous-batching pipeline, so the two compare like for like. tools/bench_serve.py calls it.

    python engine_runner.py FOLDER LOAD.json  -> one JSON line on stdout: {"requests": [...], "load_s", "peak_rss_mb"}

LOAD.json as cb_runner's: {"chats": [[system or null, user], ...], "new": N, "at_once": C, "threads": T (0: none
given), "max_seqs": S, "context": X}. Each chat goes through the folder's chat template; greedy, N tokens each (no
stop token, as ignore_eos). At most C requests are submitted at once; a finished one lets the next in. Each request's
record: its tag, start, first token, end, each token's arrival, its token count.
"""

from __future__ import annotations

import json
import sys
import time

from load_records import report  # tools/, beside this script (run as a script, from any environment)


def run(folder: str, load: dict) -> dict:
    from aqua_export.runtime.lm import OrtLM
    from aqua_export.runtime.sampling import SamplingConfig
    from aqua_export.runtime.text import load_tokenizer
    from aqua_export.serving.api import chat_ids
    from aqua_export.serving.engine import Engine, Sequence

    t0 = time.perf_counter()
    context = load["context"]
    lm = OrtLM.from_folder(folder, threads=load["threads"], serving=(load["max_seqs"] + 1,
                                                                      Engine.capacity_for(context)))
    engine = Engine(lm, max_seqs=load["max_seqs"], context=context, queue=len(load["chats"]))
    tok = load_tokenizer(folder)
    prompts = [chat_ids(tok, ([{"role": "system", "content": s}] if s else []) + [{"role": "user", "content": u}])
               for s, u in load["chats"]]
    load_s = time.perf_counter() - t0
    recs, live, nxt = [], set(), 0
    sampling = SamplingConfig(max_new_tokens=load["new"])

    def listener(i):
        def on_event(token, finish):
            now = time.perf_counter()
            if token is not None:
                recs[i]["arrivals"].append(now)
            if finish is not None:
                recs[i]["end"] = now
                live.discard(i)
        return on_event

    while nxt < len(prompts) or engine.busy():
        while nxt < len(prompts) and len(live) < load["at_once"]:
            recs.append({"tag": nxt, "start": time.perf_counter(), "arrivals": []})
            live.add(nxt)
            engine.submit(Sequence(prompts[nxt], sampling, listener(nxt)))
            nxt += 1
        engine.turn()
    return report(recs, load_s)


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], json.loads(open(sys.argv[2]).read()))))
