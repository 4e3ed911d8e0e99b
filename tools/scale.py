"""How a build's cost grows with model size: random-weight checkpoints of real shapes (bfloat16 on disk),
built into float16 folders, peak RSS and time per stage and the folder's size. Writes benchmarks/scale.md.

    python tools/scale.py [--sizes 135M,0.5B,1.1B] [--work DIR]      (not run in CI: minutes to an hour)

Checkpoints are written tensor by tensor (a meta-device model gives the names and shapes; no model is ever
materialised), in shards of at most 2 GB, with the embedded SmolLM2 tokenizer; nothing comes from a hub.
Each build runs in its own process; aqua_config.json's "resources" hold each stage's time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

# name: (HF architecture, its config).  Llama's vocabulary is SmolLM2's unless the model's own is the point.
_LLAMA = dict(bos_token_id=1, eos_token_id=2)
SHAPES = {
    "135M": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, **_LLAMA)),  # SmolLM2
    "0.5B": ("llama", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=49152, tie_word_embeddings=True, **_LLAMA)),
    "1.1B": ("llama", dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=49152, tie_word_embeddings=False, **_LLAMA)),  # TinyLlama
    "8B": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, **_LLAMA,  # Llama-3.1-8B
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "OLMoE-1B-7B": ("olmoe", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                                  intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                                  vocab_size=50304, tie_word_embeddings=False, max_position_embeddings=4096,
                                  bos_token_id=1, eos_token_id=2)),  # OLMoE-1B-7B-0924
}
SHARD_BYTES = 2 * 10**9
DEFAULT_ARGS = ("--k-ratio 0.75 --dtype float16 --calib-text builtin:gpl-3 --calib-tokens 2048 "
                "--parity-prompt-tokens 128 --parity-steps 16")


def _hub_tensors(name: str, shape) -> list:
    """(name, shape) as the hub's checkpoints store a parameter: transformers fuses each MoE layer's experts into
    one [E, ...] parameter when it loads, the released checkpoints keep one matrix per expert."""
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]
        base, (e, two_i, h) = name[:-len("gate_up_proj")], shape
        return [(f"{base}{j}.{w}.weight", (two_i // 2, h)) for j in range(e) for w in ("gate_proj", "up_proj")]
    if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
        base, (e, h, i) = name[:-len("down_proj")], shape
        return [(f"{base}{j}.down_proj.weight", (h, i)) for j in range(e)]
    return [(name, tuple(shape))]


def write_checkpoint(folder: Path, name: str, seed: int = 0) -> int:
    """A random-weight checkpoint of SHAPES[name] in bfloat16 safetensors shards; returns its parameter count.

    Weights N(0, 0.02) as HF initialises them (norms 1), except the output layer, scaled so that logits
    spread like a trained model's: random-init logits are within float16 rounding of each other."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from aqua_export import models

    arch, kwargs = SHAPES[name]
    cfg = AutoConfig.for_model(arch, torch_dtype="bfloat16", **kwargs)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    cfg.architectures = [type(meta).__name__]  # as a hub config names it (genai's builder dispatches on it)
    shapes = [t for n, p in meta.state_dict().items() for t in _hub_tensors(n, p.shape)]
    tied, hidden = cfg.tie_word_embeddings, cfg.hidden_size
    if tied:
        shapes = [(n, s) for n, s in shapes if n != "lm_head.weight"]
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shard, size, index, files = {}, 0, {}, []

    def flush():
        nonlocal shard, size
        if shard:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            files.append(fname)
            index.update({k: fname for k in shard})
            shard, size = {}, 0

    params = 0
    for n, shape in shapes:
        t = torch.ones(shape) if n.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        if n == "lm_head.weight" or (tied and n == "model.embed_tokens.weight"):
            # logits spread like a trained model's (std ~5, not ~0.5): top-1 is not decided by float16 rounding
            t *= 5.0 / (0.02 * hidden ** 0.5)
        t = t.to(torch.bfloat16)
        params += t.numel()
        if size + t.numel() * 2 > SHARD_BYTES:
            flush()
        shard[n] = t
        size += t.numel() * 2
    flush()
    total = sum((tmp / f).stat().st_size for f in files)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    cfg.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(models.resolve("llama")[0]).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return params


def build(ckpt: Path, out: Path, args: list[str]) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "aqua_export", "--model", str(ckpt), "--out", str(out), *args]
    log = out.parent / (out.name + ".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    res = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": str(log)}
    if rc == 0:
        cfg = json.loads((out / "aqua_config.json").read_text())
        par = json.loads((out / "parity.json").read_text())
        res.update(resources=cfg["info"]["resources"], weights=cfg["info"]["weights"], parity_pass=par["pass"],
                   parity=par["ort_vs_reference"], top1_unforced=par["ort_vs_reference_unforced"]["top1_agreement"],
                   folder_bytes=sum(p.stat().st_size for p in out.iterdir() if p.is_file()))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="135M,0.5B,1.1B")
    ap.add_argument("--work", default=str(ROOT / "build" / "scale"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "scale.json"))
    ap.add_argument("--build-args", default=DEFAULT_ARGS)
    ap.add_argument("--report-only", action="store_true", help="rewrite benchmarks/scale.md from the JSON")
    a = ap.parse_args()
    if a.report_only:
        write_report(Path(a.json))
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(Path(a.json).read_text()) if Path(a.json).exists() else {}
    for name in a.sizes.split(","):
        ckpt = work / f"llama-{name}"
        t0 = time.perf_counter()
        params = write_checkpoint(ckpt, name)
        disk = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        print(f"{name}: {params / 1e9:.2f}B parameters, {disk / 2**30:.2f} GiB on disk "
              f"({time.perf_counter() - t0:.0f} s to write)", flush=True)
        res = build(ckpt, work / f"engine-{name}", a.build_args.split())
        res.update(params=params, disk_bytes=disk, build_args=a.build_args)
        results[name if a.build_args == DEFAULT_ARGS else f"{name}, {a.build_args}"] = res
        print(json.dumps(res, indent=1), flush=True)
        shutil.rmtree(work / f"engine-{name}", ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        Path(a.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    write_report(Path(a.json))


def write_report(build_json: Path = ROOT / "benchmarks" / "scale.json") -> None:
    """benchmarks/scale.md: the build half from build_json, the serving half from tools/serving.py's JSON."""
    from serving import report_lines

    results = json.loads(build_json.read_text()) if build_json.exists() else {}
    stages = ["load", "calibrate", "export", "parity"]
    md = ["# Building and serving against model size", "",
          "## Building", "", "Written by `python tools/scale.py` (random-weight Llama-shaped checkpoints, bfloat16 on disk, built on "
          "this project's 2-core, 24 GiB CPU machine into float16 folders). Per stage: seconds / peak RSS in GiB "
          "(VmHWM reset at each stage start; it counts the mapped pages of the checkpoint and of model.onnx.data, which "
          "the kernel can drop and re-read under pressure). Target: peak <= 1.5 x disk + 3 GiB.", "",
          "| model | parameters | disk (GiB) | " + " | ".join(stages) + " | peak (GiB) | target (GiB) | folder (GiB) | "
          "wall (s) | parity |", "|---" * (len(stages) + 8) + "|"]
    notes = []
    for name, r in sorted(results.items(), key=lambda kv: kv[1]["params"]):
        if r["build_args"] != DEFAULT_ARGS:
            notes.append(f"`{name.split(',')[0]}*{len(notes) + 1}`: `--sizes {name.split(',')[0]} --build-args "
                         f"\"{r['build_args']}\"`")
            name = f"{name.split(',')[0]}*{len(notes)}"
        disk = r["disk_bytes"] / 2**30
        if r["rc"] != 0:
            md.append(f"| {name} | {r['params'] / 1e9:.2f}B | {disk:.2f} | " + " | ".join("-" for _ in stages)
                      + f" | - | {1.5 * disk + 3:.1f} | - | {r['seconds']} | build failed (rc {r['rc']}, see its log) |")
            continue
        res = r["resources"]
        peak = max(res[s]["peak_rss_gib"] for s in stages if s in res)
        cells = [f"{res[s]['seconds']:.0f} s / {res[s]['peak_rss_gib']:.1f}" if s in res else "-" for s in stages]
        p = r["parity"]
        md.append(f"| {name} | {r['params'] / 1e9:.2f}B | {disk:.2f} | " + " | ".join(cells) +
                  f" | {peak:.1f} | {1.5 * disk + 3:.1f} | {r['folder_bytes'] / 2**30:.2f} | {r['seconds']} | "
                  f"{'pass' if r['parity_pass'] else 'FAIL'}: {p['max_abs_logit_diff_prefill']:.2f} / "
                  f"{p['max_abs_logit_diff_decode']:.2f}, top-1 {r['top1_unforced']:.2f} |")
    md += ["", f"Build: `aqua-export --model DIR {DEFAULT_ARGS}`, except rows marked * (same tool, other arguments):",
           *[f"- {x}" for x in notes],
           "", "Parity: float16 ORT vs the float32 PyTorch reference, max |dlogit| prefill / decode under ORT's selection "
           "(gate 0.5), and top-1 agreement with each side selecting on its own (gate 0.95 counting float16 "
           "near-ties). A failed build's figures are in its log (build/scale/engine-NAME.log)."]
    md += ["", *report_lines()]
    (ROOT / "benchmarks" / "scale.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
