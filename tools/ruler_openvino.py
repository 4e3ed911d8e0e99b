"""OpenVINO GenAI as an lm-evaluation-harness model (generate_until only), for RULER's needle tasks
(tools/ruler_items.py). Runs in OpenVINO's own virtual environment (build/venvs/openvino, lm_eval[ruler] added by
tools/quality_ruler.py); writes the scores as JSON:

    build/venvs/openvino/bin/python -m tools.ruler_openvino FOLDER MODE TOKENIZER OUT.json \
        --tasks niah_single_1 --lengths 2048 --items 20 --threads 2

MODE: dense (its continuous-batching pipeline, no sparse attention), xattention (threshold 0.8, blocks of 64, stride
8: OpenVINO's documented settings, as tools/request_runner.py runs it), xattention-all (the same at threshold 0.9999,
where every block's mass is kept: a control that should answer as dense does) or trishape (its defaults).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODES = ("dense", "xattention", "xattention-all", "trishape")
THRESHOLDS = {"xattention": 0.8, "xattention-all": 0.9999}


def pipeline(folder: str, mode: str, threads: int):
    import openvino_genai as ovg

    sc = ovg.SchedulerConfig()
    if mode != "dense":
        sc.use_sparse_attention = True
        cfg = ovg.SparseAttentionConfig()
        if mode in THRESHOLDS:
            cfg.mode = ovg.SparseAttentionMode.XATTENTION
            cfg.xattention_threshold, cfg.xattention_block_size, cfg.xattention_stride = THRESHOLDS[mode], 64, 8
        else:
            cfg.mode = ovg.SparseAttentionMode.TRISHAPE
        sc.sparse_attention_config = cfg
    return ovg.LLMPipeline(folder, "CPU", scheduler_config=sc, INFERENCE_NUM_THREADS=threads)


def model_class():
    from lm_eval.api.model import LM

    class OpenVinoLM(LM):
        """Greedy text through an LLMPipeline, the prompt tokenized as lm-eval's HF models do (no special tokens
        added), cut at the request's stop strings."""

        def __init__(self, pipe, tokenizer):
            super().__init__()
            self.pipe, self.tok = pipe, tokenizer

        def generate_until(self, requests, disable_tqdm: bool = False):
            import numpy as np
            import openvino as ov
            import openvino_genai as ovg

            out = []
            for req in requests:
                context, kw = req.args
                ids = np.array([self.tok(context, add_special_tokens=False)["input_ids"]], np.int64)
                config = ovg.GenerationConfig(max_new_tokens=int(kw.get("max_gen_toks", 128)), do_sample=False)
                res = self.pipe.generate(ovg.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), config)
                text = self.tok.decode(res.tokens[0], skip_special_tokens=True)
                for stop in kw.get("until") or []:
                    text = text.split(stop)[0]
                out.append(text)
            return out

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("OpenVinoLM generates only (RULER's tasks)")

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("OpenVinoLM generates only (RULER's tasks)")

    return OpenVinoLM


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from tools.ruler_items import TASKS, scores

    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("tokenizer")
    ap.add_argument("out")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--items", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    lm = model_class()(pipeline(a.folder, a.mode, a.threads), AutoTokenizer.from_pretrained(a.tokenizer))
    got = scores(lm, a.tasks.split(","), [int(x) for x in a.lengths.split(",")], a.items, a.tokenizer)
    Path(a.out).write_text(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
