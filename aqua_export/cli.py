"""Command line: ``aqua-export {calibrate,eval,retention} ...``.

Every bad input ends in one line on stderr, ``aqua-export: error: ...``, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import AquaConfig, ConfigError


def _model_arg(p):
    p.add_argument("--model", default="llama", help="HF model id, local HF folder, .gguf file, or 'llama' (embedded SmolLM2-135M-Instruct)")


def _config_args(p):
    p.add_argument("--k-ratio", type=float, default=1.0)
    p.add_argument("--slice-ratio", type=float, default=0.0)
    p.add_argument("--h2o-ratio", type=float, default=1.0)
    p.add_argument("--selection", default="magnitude")


def _config(a) -> AquaConfig:
    return AquaConfig(k_ratio=a.k_ratio, slice_ratio=a.slice_ratio, h2o_ratio=a.h2o_ratio, selection=a.selection)


def _check_out_file(path: str) -> Path:
    """Fail before any work if the output cannot be written (the write itself is atomic)."""
    import tempfile

    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder: give a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise ConfigError(f"--out {out} is not writable ({e.strerror}): choose another path") from None
    return out


def cmd_calibrate(a) -> int:
    from . import calibrate, models

    out = _check_out_file(a.out)
    model, tok = models.load(a.model)
    tensors, meta = calibrate.calibrate(model, tok, texts=a.text or None, tokens=a.tokens, seq_len=a.seq_len,
                                        seed=a.seed, progress=not a.quiet)
    calibrate.write(out, tensors, meta)
    print(f"wrote {out} ({meta['tokens']} tokens of {meta['corpus']})")
    return 0


def cmd_eval(a) -> int:
    from . import calibrate, corpus, evaluate, models

    cfg = _config(a)
    projection = calibrate.load_projection(a.projection) if a.projection else None
    text = corpus.read_text(a.text)
    model, tok = models.load(a.model)
    res = evaluate.perplexity(model, tok, text, tokens=a.tokens, seq_len=a.seq_len, projection=projection,
                              config=cfg, progress=not a.json)
    res["model"] = a.model
    res["text"] = a.text
    if a.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(f"perplexity {res['perplexity']:.4f} over {res['predicted_tokens']} predicted tokens "
              f"({res['windows']} windows of {a.seq_len}) with {cfg.to_json()}")
    return 0


def cmd_retention(a) -> int:
    from . import calibrate, corpus, evaluate, models
    from .safetensors_io import atomic_write_bytes

    AquaConfig(k_ratio=a.k_ratio)
    projection = calibrate.load_projection(a.projection)
    text = corpus.read_text(a.text)
    model, tok = models.load(a.model)
    projection.check_model(model)
    rep = evaluate.retention_report(model, tok, text, projection, tokens=a.tokens, seq_len=a.seq_len, k_ratio=a.k_ratio)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "retention.json", json.dumps(rep, indent=1, sort_keys=True).encode())
    tmp_png = out / ".retention.png.tmp.png"
    evaluate.plot_retention(rep, tmp_png)
    tmp_png.replace(out / "retention.png")
    for k, v in rep["mean"].items():
        print(f"{k:20s} mean retention loss {v:.4f}")
    print(f"wrote {out / 'retention.json'} and {out / 'retention.png'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="aqua-export", description="AQUA attention for Hugging Face decoder LLMs")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("calibrate", help="compute the projection artifact")
    _model_arg(p)
    p.add_argument("--text", action="append", help="plain-text/JSONL file or builtin:NAME (repeatable); default: self-generated text")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_calibrate)

    p = sub.add_parser("eval", help="perplexity with or without AQUA")
    _model_arg(p)
    p.add_argument("--projection")
    _config_args(p)
    p.add_argument("--text", required=True)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("retention", help="information retention loss per layer/head, JSON + PNG")
    _model_arg(p)
    p.add_argument("--projection", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--k-ratio", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(fn=cmd_retention)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except ConfigError as e:
        print(f"aqua-export: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
