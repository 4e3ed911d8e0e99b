"""onnxruntime-genai hosts built folders: greedy tokens and logits equal to `aqua-export run`'s, in both of
genai's buffer modes, batch 1 and a batch of prompts of different lengths (embedded model, slow)."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is a dependency of the package (pip install -e .)")

from aqua_export.build import export_folder  # noqa: E402
from aqua_export.options import BuildOptions  # noqa: E402
from aqua_export.config import AquaConfig, ConfigError  # noqa: E402
from aqua_export.runtime.sampling import SamplingConfig
from aqua_export.runtime.text import encode_prompts

SETTINGS = {"dense": AquaConfig(), "k0.75": AquaConfig(k_ratio=0.75), "k0.5": AquaConfig(k_ratio=0.5),
            "memory-s0.25-k0.75": AquaConfig(k_ratio=0.75, slice_ratio=0.25), "k0.75-kv-float16": AquaConfig(k_ratio=0.75),
            # k spread over the layers, each layer's heads sharing it per token (head_prices on every node)
            "k0.5-alloc-energy": AquaConfig(k_ratio=0.5, k_alloc="energy")}
OPTIONS = {"k0.75-kv-float16": BuildOptions(cache_dtype="float16")}  # a float16 cache under the float32 graph
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The GNU General Public License is a free, copyleft license for",
           "Once upon a time",
           "import numpy as np\n\n# a function that normalises the rows of a matrix\ndef"]
STEPS = 32


@pytest.fixture(scope="module")
def folders(smollm, smollm_projection, tmp_path_factory):
    """The settings exported into folders by the build's own export stage (parity is test_build's)."""
    model, tok = smollm
    out = {}
    for name, cfg in SETTINGS.items():
        d = tmp_path_factory.mktemp(name)
        export_folder(model, tok, smollm_projection, cfg, OPTIONS.get(name, BuildOptions()), d, "llama").seal(d)
        out[name] = d
    return out


def _generate(lm, tok, prompts):
    ids, mask = encode_prompts(tok, prompts)
    logits = []
    got = lm.generate(ids, mask, SamplingConfig(max_new_tokens=STEPS), eos_token_id=tok.eos_token_id,
                      on_logits=lambda step, x: logits.append(np.asarray(x)))
    return got, logits


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_genai_equals_aqua_run(folders, smollm, name):
    from aqua_export.runtime.hosts import open_lm
    from aqua_export.runtime.text import load_tokenizer

    folder = folders[name]
    tok = load_tokenizer(folder)
    gc = json.loads((folder / "genai_config.json").read_text())
    assert gc["model"]["decoder"]["head_size"] == (48 if "memory" in name else 64)
    assert gc["model"]["decoder"]["session_options"]["custom_ops_library"] == "libaqua_ort.so"
    assert gc["model"]["decoder"]["session_options"]["enable_cpu_mem_arena"] is True  # a long prompt's peak halves
    for prompts in (PROMPTS[:1], PROMPTS):
        ours, our_logits = _generate(open_lm(folder, "aqua"), tok, prompts)
        assert ours.shape[1] > 16, "the prompts must make the model talk"
        for share in (True, False):
            theirs, their_logits = _generate(open_lm(folder, "genai", share_buffer=share), tok, prompts)
            assert np.array_equal(theirs, ours), (name, len(prompts), share)
            # logits of every real row at every step (rows that finished emit eos and are not compared)
            live = np.concatenate([np.ones((len(prompts), 1), bool),
                                   np.cumsum(ours == tok.eos_token_id, axis=1)[:, :-1] == 0], axis=1)
            worst = max(np.abs(a - b)[live[:, s]].max(initial=0) for s, (a, b) in enumerate(zip(our_logits, their_logits)))
            assert worst <= 1e-3, (name, len(prompts), share, worst)


@pytest.mark.parametrize("text", ["{", '{"model": {}}'])
def test_damaged_genai_config_is_one_line(tmp_path, text):
    from aqua_export.contract import Contract
    from aqua_export.runtime.folder import FolderConfig, Geometry
    from aqua_export.runtime.genai import GenaiLM

    FolderConfig(model="llama", aqua=AquaConfig(), geometry=Geometry(2, 4, 2, 16, 64),
                 contract=Contract(layers=2, kv_heads=2, widths=(16, 16), selected=(16, 16), value_widths=(16, 16), vocab=100)).seal(tmp_path)
    with pytest.raises(ConfigError, match="has no genai_config.json: rebuild the folder") as e:
        GenaiLM(tmp_path)
    assert "\n" not in str(e.value)
    (tmp_path / "genai_config.json").write_text(text)
    with pytest.raises(ConfigError, match="cannot be loaded by onnxruntime-genai.*rebuild the folder") as e:
        GenaiLM(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("what", ["h2o", "widths"])
def test_genai_refuses_h2o_and_allocated_folders_with_one_line(tmp_path, what):
    from aqua_export.contract import Contract
    from aqua_export.runtime.folder import FolderConfig, Geometry
    from aqua_export.runtime.genai import GenaiLM

    if what == "h2o":
        aqua, widths, value_widths = AquaConfig(k_ratio=0.75, h2o_ratio=0.5), (16, 16), (16, 16)
    else:  # slice 0.25 of 16 -> 12 on average, spent 8 / 16 on K^ and V
        aqua, widths, value_widths = AquaConfig(k_ratio=0.75, slice_ratio=0.25, slice_alloc="energy"), (8, 12), (16, 12)
    FolderConfig(model="llama", aqua=aqua, geometry=Geometry(2, 4, 2, 16, 64),
                 contract=Contract(layers=2, kv_heads=2, widths=widths, selected=tuple(round(0.75 * w) for w in widths),
                                   value_widths=value_widths, vocab=100, h2o=what == "h2o")).write(tmp_path)
    with pytest.raises(ConfigError, match="--runtime aqua") as e:
        GenaiLM(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_chunked_prefill_equals_one_forward(folders, monkeypatch):
    """A prompt longer than the chunk, prefilled in forwards of 16 tokens (`aqua-export run`: OrtLM.prefill; genai:
    search.chunk_size, which a user may set at batch 1) gives the tokens and, within float noise, the logits of one
    forward of the whole prompt."""
    import onnxruntime_genai as og

    from aqua_export.runtime import lm as lm_module
    from aqua_export.runtime.hosts import open_lm
    from aqua_export.runtime.text import load_tokenizer

    folder = folders["k0.75"]
    tok = load_tokenizer(folder)
    prompt = [" ".join(PROMPTS) * 2]
    ids, _ = encode_prompts(tok, prompt)
    assert ids.shape[1] > 100
    whole, whole_logits = _generate(open_lm(folder, "aqua"), tok, prompt)
    calls = []
    lm = open_lm(folder, "aqua")
    step = lm.step
    monkeypatch.setattr(lm, "step", lambda i, m, p, *last: (calls.append(i.shape[1]), step(i, m, p, *last))[1])
    monkeypatch.setattr(lm_module, "PREFILL_CHUNK", 16)
    chunked, chunked_logits = _generate(lm, tok, prompt)
    assert calls[:ids.shape[1] // 16] == [16] * (ids.shape[1] // 16), calls[:12]  # the prompt went in 16 at a time
    assert np.array_equal(chunked, whole)
    assert max(np.abs(a - b).max() for a, b in zip(chunked_logits, whole_logits)) <= 1e-3
    config = og.Config(str(folder))
    config.overlay(json.dumps({"search": {"chunk_size": 16}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=ids.shape[1] + STEPS, batch_size=1)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    first = np.asarray(gen.get_logits()).reshape(-1)
    assert np.abs(first - whole_logits[0][0]).max() <= 1e-3  # genai's chunked prefill: the same last logits
    got = []
    for _ in range(whole.shape[1]):
        gen.generate_next_token()
        got.append(int(np.asarray(gen.get_next_tokens())[0]))
    assert got == whole[0].tolist()


THREADS_PROBE = """
import json, sys, threading, os
import onnxruntime as ort, onnxruntime_genai as og
folder = sys.argv[1]
def count():
    return len(os.listdir("/proc/self/task"))
def grown(make):
    before = count(); keep = make(); return count() - before, keep
def ort_session(threads):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(os.path.join(folder, "libaqua_ort.so"))
    return ort.InferenceSession(os.path.join(folder, "model.onnx"), so)
def genai_model(threads):
    config = og.Config(folder)
    if threads is not None:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(config)
kept = [genai_model(1)]  # genai's own threads (made at its first model) out of the counts below
ort_one, k = grown(lambda: ort_session(1)); kept.append(k)
ort_default, k = grown(lambda: ort_session(0)); kept.append(k)
genai_one, k = grown(lambda: genai_model(1)); kept.append(k)
genai_default, k = grown(lambda: genai_model(None)); kept.append(k)
print(json.dumps({"ort": ort_default - ort_one, "genai": genai_default - genai_one}))
"""


@pytest.mark.slow
def test_genai_opens_a_folder_on_the_machines_cores(folders):
    """og.Model(folder) with nothing set runs as many intra-op threads as ONNX Runtime's own default (one per
    physical core), not genai's hardware_concurrency() / 2 (one thread on a 2-core machine without SMT): the
    folder's genai_config says 0, which means ONNX Runtime's default on whichever machine opens it."""
    import subprocess
    import sys

    folder = folders["dense"]
    gc = json.loads((folder / "genai_config.json").read_text())
    assert gc["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 0
    r = subprocess.run([sys.executable, "-c", THREADS_PROBE, str(folder)], capture_output=True, text=True, check=True)
    extra = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"intra-op threads beyond one: ONNX Runtime's default {extra['ort']}, genai's opening of the folder "
          f"{extra['genai']} ({os.cpu_count()} CPUs)")
    assert extra["genai"] == extra["ort"], extra
