"""`aqua-export serve`: continuous batching never changes results (dense and token-selection folders, with and without
the prefix cache), and the OpenAI API as the official `openai` client sees it, under load and faults (429, a client
that goes away, SIGTERM, kill -9 and a restart)."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from helpers import tiny_folder

from aqua_export.config import AquaConfig, ConfigError
from aqua_export.runtime.caches import RowCache
from aqua_export.runtime.lm import OrtLM
from aqua_export.runtime.sampling import SamplingConfig
from aqua_export.serving.engine import Engine, Sequence

CONTEXT = 128


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_llama):
    """A dense folder (k 0.5), a token-selection one (budget 32 tokens: 2 pages) and one caching int8 rows under
    the group-weighted rule (K^ with the nodes' key_weights), each with a tokenizer."""
    m, proj = tiny_llama
    out = {}
    tokens = AquaConfig(k_ratio=0.5, token_budget=32)
    for name, cfg, cache in (("dense", AquaConfig(k_ratio=0.5), None), ("tokens", tokens, None),
                             ("int8", dataclasses.replace(tokens, selection="group-weighted"), "int8")):
        out[name] = tiny_folder(m, proj, cfg, tmp_path_factory.mktemp(name), cache_dtype=cache)
    return out


def _requests(n: int, seed: int = 0, shared: int = 0):
    """n (prompt ids, tokens to generate) of mixed lengths; with ``shared``, every other prompt starts with the same
    ``shared`` tokens (a system prompt)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(4, 128, shared)
    out = [(rng.integers(4, 128, 3), 40)]  # a short prompt first: the longer ones that follow move the rows right
    for i in range(1, n):
        p = rng.integers(4, 128, int(rng.integers(3, 80 - shared)))
        out.append((np.concatenate([system, p]) if shared and i % 2 == 0 else p, int(rng.integers(1, 48))))
    return out


def _serve_all(lm, requests, **engine_args):
    """Every request submitted at once to an Engine run in this thread: (ids per request, the engine)."""
    engine = Engine(lm, context=CONTEXT, queue=len(requests), margin=16, **engine_args)  # compacts every 16 steps
    seqs = [Sequence(p, SamplingConfig(max_new_tokens=n), lambda t, f: None) for p, n in requests]
    for s in seqs:
        engine.submit(s)
    while engine.busy():
        engine.turn()
    return [s.out for s in seqs], engine


@pytest.mark.parametrize("kind", ["dense", "tokens", "int8"])
def test_batching_never_changes_results(folders, kind, monkeypatch):
    """32 requests of mixed lengths, 8 at a time, prefilled in chunks between the others' steps, with the rows moved
    left and right as they come and go and the row cache regrown (in steps of 16 slots here) as they join and lengthen:
    token for token what each gives alone; with the prefix cache on (half the prompts share a 64-token prefix) too,
    and the prefix cache is used. The int8 folder's rows (codes and scale) move like any others."""
    monkeypatch.setattr(RowCache, "GROW", 16)
    lm = OrtLM.from_folder(folders[kind], threads=1)
    if kind == "int8":
        import onnx

        m = onnx.load(str(folders[kind] / "model.onnx"), load_external_data=False)
        nodes = [n for n in m.graph.node if n.op_type == "AquaAttention"]
        assert nodes and all(any(a.name == "key_weights" for a in n.attribute) for n in nodes)
    for shared in (0, 64):
        reqs = _requests(32, seed=shared, shared=shared)
        alone, _ = _serve_all(lm, reqs, max_seqs=1, chunk=16)
        batched, engine = _serve_all(lm, reqs, max_seqs=8, chunk=16, prefix_bytes=(1 << 20) * shared)
        assert min(engine.moves.values()) > 0 and engine.steps < sum(n for _, n in reqs), (engine.moves, engine.steps)
        assert engine.rows.regrown >= 4 and engine.rows.held == 8, (engine.rows.regrown, engine.rows.held)
        if shared:
            assert engine.prefix.hits >= 8 and engine.prefix.reused_tokens >= 8 * 64
        for i, (a, b) in enumerate(zip(alone, batched)):
            assert a == b, (kind, shared, i)
    # and alone through the engine is OrtLM.generate's answer (the whole prompt in one forward)
    p, n = reqs[1]
    assert alone[1] == lm.generate(p[None], np.ones((1, len(p)), np.int64), SamplingConfig(max_new_tokens=n))[0].tolist()


def test_the_row_cache_takes_memory_as_sequences_come(folders, monkeypatch):
    """An engine of 8 rows of 144 slots serving one short request holds one row of the slots it used (in steps of 16
    here), not the 8 x 144 its limits allow; 8 requests at once hold 8 rows."""
    monkeypatch.setattr(RowCache, "GROW", 16)
    lm = OrtLM.from_folder(folders["dense"], threads=1)
    _, one = _serve_all(lm, [(np.arange(4, 24), 8)], max_seqs=8)
    _, eight = _serve_all(lm, [(np.arange(4, 24), 8)] * 8, max_seqs=8)
    assert (one.rows.held, one.rows.capacity) == (1, 144) and one.rows.slots < 144
    per_slot = one.rows.nbytes // (one.rows.held * one.rows.slots)
    assert one.rows.nbytes == per_slot * one.rows.slots and eight.rows.held == 8
    assert one.rows.nbytes * 8 <= per_slot * 8 * 144 // 4  # a quarter of a reservation at the limits, or less


def test_prefix_cache_is_bounded_and_evicts_the_oldest(folders):
    lm = OrtLM.from_folder(folders["dense"], threads=1)
    per_chunk = lm.contract.cache_bytes(1, 16)
    engine = Engine(lm, max_seqs=2, context=CONTEXT, chunk=16, prefix_bytes=per_chunk * 6)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 128, 50) for _ in range(3)]  # 48 tokens kept of each: 3 chunks
    for p in prompts:
        _serve_one(engine, p, times=2)  # kept at its second sighting
    assert engine.prefix.used <= per_chunk * 6 and len(engine.prefix.entries) == 2
    assert engine.prefix.lookup(prompts[0])[0] == 0 and engine.prefix.lookup(prompts[2])[0] == 48


def test_the_prefix_cache_keeps_a_start_seen_twice_and_nothing_else(folders):
    """Distinct prompts hold no memory (each is a first sighting); of prompts sharing a 32-token start, the first is
    only remembered, the second is kept, the third reuses its rows."""
    lm = OrtLM.from_folder(folders["dense"], threads=1)
    engine = Engine(lm, max_seqs=2, context=CONTEXT, chunk=16, prefix_bytes=1 << 20)
    rng = np.random.default_rng(4)
    for p in [rng.integers(4, 128, 40) for _ in range(4)]:
        _serve_one(engine, p)
    assert (engine.prefix.used, len(engine.prefix.entries), engine.prefix.first_sightings) == (0, 0, 4)
    start = rng.integers(4, 128, 32)
    tails = [rng.integers(4, 128, 9) for _ in range(3)]
    _serve_one(engine, np.concatenate([start, tails[0]]))
    assert not engine.prefix.entries and engine.prefix.hits == 0
    _serve_one(engine, np.concatenate([start, tails[1]]))
    assert len(engine.prefix.entries) == 1 and engine.prefix.hits == 0
    _serve_one(engine, np.concatenate([start, tails[2]]))
    assert (engine.prefix.hits, engine.prefix.reused_tokens) == (1, 32)


def _serve_one(engine, prompt, times: int = 1) -> None:
    for _ in range(times):
        engine.submit(Sequence(prompt, SamplingConfig(max_new_tokens=2), lambda t, f: None))
        while engine.busy():
            engine.turn()


def test_the_engine_refuses_what_cannot_fit(folders):
    lm = OrtLM.from_folder(folders["dense"], threads=1)
    engine = Engine(lm, max_seqs=1, context=CONTEXT, queue=1)
    with pytest.raises(ConfigError, match="exceed the context of 128 tokens"):
        engine.submit(Sequence(np.arange(4, 104), SamplingConfig(max_new_tokens=40), lambda t, f: None))
    engine.submit(Sequence(np.arange(4, 14), SamplingConfig(max_new_tokens=4), lambda t, f: None))
    with pytest.raises(Exception, match="1 requests are waiting"):
        engine.submit(Sequence(np.arange(4, 14), SamplingConfig(max_new_tokens=4), lambda t, f: None))


# ---------------------------------------------------------------------------------------------- the HTTP server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`aqua-export serve` in a child process on 127.0.0.1 (stopped by the test or at exit)."""

    def __init__(self, folder, *args, port=None):
        self.model = folder.name  # the id clients name: the folder's name by default
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "aqua_export", "serve", str(folder), "--port",
                                      str(self.port), "--threads", "1", "--context", str(CONTEXT), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()[1]
            try:
                if self.health()["status"] == "ok":
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not start in 120 s")

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def stop(self, sig=signal.SIGTERM, timeout=60) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def server(folders):
    s = Server(folders["tokens"], "--max-seqs", "4")
    yield s
    s.stop()


def test_openai_client_completions_and_chat(server, folders):
    """Greedy (temperature 0): streamed text equals the whole answer, which equals the engine's own tokens decoded;
    usage counts them; a stop string cuts the text and finishes with "stop"."""
    from aqua_export.runtime.text import load_tokenizer

    c = server.client()
    assert [m.id for m in c.models.list().data] == [folders["tokens"].name]
    whole = c.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=24, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=server.model, prompt="The quick brown fox", max_tokens=24, temperature=0, stream=True))
    assert whole.choices[0].text == streamed and whole.usage.prompt_tokens == 19
    tok = load_tokenizer(folders["tokens"])
    lm = OrtLM.from_folder(folders["tokens"], threads=1)
    ids = tok("The quick brown fox")["input_ids"]
    out, _ = _serve_all(lm, [(np.array(ids), 24)], max_seqs=1, chunk=512)
    assert whole.choices[0].text == tok.decode(out[0], skip_special_tokens=True)
    assert whole.usage.completion_tokens == len(out[0])
    by_ids = c.completions.create(model=server.model, prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=20, temperature=0)
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=20, temperature=0, stream=True) if ch.choices]
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == "".join(parts)
    text = whole.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2] if len(text) >= 4 else None
    if stop:
        cut = c.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=24, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.find(stop)]
    seeded = [c.completions.create(model=server.model, prompt="abc", max_tokens=12, seed=7).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]  # sampling (temperature 1) with a seed repeats


def test_bad_requests_get_openai_errors(server):
    import openai

    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=server.model, prompt="x" * 100, max_tokens=100)
    assert e.value.code == "context_length_exceeded" and "context is 128 tokens" in e.value.message
    for bad in ({"temperature": 3}, {"n": 2}, {"prompt": ""}, {"prompt": [1, 500]}, {"max_tokens": 0},
                {"stop": [""]}, {"logprobs": 2}):
        args = {"model": server.model, "prompt": "hi", "max_tokens": 4} | bad
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**args)
        assert e.value.body["type"] == "invalid_request_error", bad
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=server.model, messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt="hi", max_tokens=4)
    assert e.value.code == "model_not_found"
    for body in (b"{not json", b'{"prompt": "\xff\xfe", "model": "x"}', b"[1, 2]"):
        req = urllib.request.Request(server.url + "/v1/completions", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400 and "JSON" in json.loads(e.value.read())["error"]["message"], body
    assert server.health()["status"] == "ok"  # and it keeps serving
    metrics = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
    assert 'aqua_requests_rejected_total{reason="invalid"}' in metrics
    assert "aqua_time_to_first_token_seconds_count" in metrics and "aqua_generated_tokens_total" in metrics


def test_a_client_that_goes_away_frees_its_row(folders):
    """A stream closed after its first piece: the sequence is cancelled (not run to its 480 tokens) and its row
    freed."""
    server = Server(folders["dense"], "--context", "500")  # the tiny model's positions: a long answer to cut
    try:
        c = server.client()
        stream = c.completions.create(model=server.model, prompt="Tell me a long story", max_tokens=478,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        deadline = time.time() + 10
        while server.health()["cancelled"] == 0 and time.time() < deadline:
            time.sleep(0.02)
        h = server.health()
        assert h["cancelled"] == 1 and h["running"] == 0 and h["generated"] < 478, h
    finally:
        server.stop()


def test_an_api_key_is_asked_when_set(folders):
    import openai

    s = Server(folders["dense"], "--api-key", "sesame")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client().completions.create(model=s.model, prompt="hi", max_tokens=2)
        assert e.value.code == "invalid_api_key"
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0)
        assert c.completions.create(model=s.model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert s.health()["status"] == "ok"  # health and metrics ask for no key (probes, scrapers)
    finally:
        s.stop()


def test_a_full_queue_answers_429_with_retry_after(folders):
    import openai

    s = Server(folders["dense"], "--max-seqs", "1", "--queue", "1", "--chunk", "4")
    try:
        c = s.client()
        results, errors = [], []

        def one():
            try:
                results.append(c.completions.create(model=s.model, prompt="a" * 40, max_tokens=80, temperature=0))
            except openai.RateLimitError as e:
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors and results and len(errors) + len(results) == 6
        assert errors[0].response.headers["retry-after"] == "1"
        assert all(r.choices[0].text == results[0].choices[0].text for r in results)
    finally:
        s.stop()


def test_sigterm_finishes_requests_in_flight_and_kill_9_restarts(folders):
    s = Server(folders["dense"], "--max-seqs", "2")
    c = s.client()
    stream = c.completions.create(model=s.model, prompt="Once upon a time", max_tokens=100, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    s.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest and rest[-1].choices[0].finish_reason in ("length", "stop")
    assert len(first.choices[0].text + "".join(ch.choices[0].text for ch in rest)) > 0
    code, err = s.stop()
    assert code == 0 and "server stopped by SIGTERM; 1 requests served" in err, err
    # kill -9 under load, then a restart on the same port serves at once (the server owns no file)
    s = Server(folders["dense"], "--max-seqs", "2", port=s.port)
    threads = [threading.Thread(target=lambda: _swallow(s.client().completions.create, model=s.model, prompt="abc",
                                                         max_tokens=100)) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    s.stop(signal.SIGKILL)
    for t in threads:
        t.join()
    s = Server(folders["dense"], "--max-seqs", "2", port=s.port)
    try:
        assert s.client().completions.create(model=s.model, prompt="abc", max_tokens=3).usage.completion_tokens >= 1
    finally:
        s.stop()


def _swallow(fn, **kw):
    try:
        fn(**kw)
    except Exception:  # the server was killed under it: what the test does
        pass


def test_serve_refuses_bad_options_before_loading(folders, tmp_path, capsys):
    from aqua_export.cli import main

    for flag, value, line in (("--max-seqs", "0", "--max-seqs 0: give 1 or more"),
                              ("--chunk", "0", "--chunk 0: give 1 or more"),
                              ("--queue", "-1", "--queue -1: give 0 or more"),
                              ("--port", "70000", "--port 70000: give a port in 1..65535"),
                              ("--context", "-3", "--context -3: give 0 or more")):
        assert main(["serve", str(folders["dense"]), flag, value]) == 2
        err = capsys.readouterr().err
        assert line in err and err.count("--") == 1, err  # the bad flag alone
    # a context no chat fits is refused before the model loads, not at every request
    assert main(["serve", str(folders["dense"]), "--context", "5"]) == 2
    assert "--context 5 cannot hold a request: the folder's chat template around an empty message takes 17 tokens" \
        in capsys.readouterr().err
    assert main(["serve", str(folders["dense"]), "--context", "100000"]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", str(folders["dense"]), "--port", str(busy.getsockname()[1])]) == 2
    assert "choose another --port" in capsys.readouterr().err
    assert main(["serve", str(tmp_path)]) == 2
    assert "aqua_config.json" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_serving_imports_no_torch(folders):
    """The server's process (folder, engine, API app) never imports torch or transformers."""
    code = ("import sys; from aqua_export.runtime.lm import OrtLM; from aqua_export.runtime.text import load_tokenizer; "
            "from aqua_export.serving.api import Api; from aqua_export.serving.engine import Engine; "
            "lm = OrtLM.from_folder(sys.argv[1], threads=1); "
            "Api(Engine(lm, max_seqs=2, context=64), load_tokenizer(sys.argv[1]), 'm').app(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(folders["dense"])], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]", r.stdout


def test_a_stop_string_found_after_the_engine_finished_is_a_stop():
    """The engine's thread can run to max_tokens before the event loop reads the token that completes a stop string
    (a loaded machine): the answer still finishes with "stop", cut there, and the tokens after it are not counted."""
    import asyncio
    from types import SimpleNamespace

    from aqua_export.serving.api import Run

    cancelled = []
    api = SimpleNamespace(engine=SimpleNamespace(cancel=cancelled.append), eos=frozenset(),
                          tok=SimpleNamespace(decode=lambda ids, **kw: "".join(chr(96 + i) for i in ids)))

    async def main():
        run = Run(api, [1, 2], SamplingConfig(max_new_tokens=4), ["cd"], chat=False)
        for event in ((1, None), (3, None), (4, None), (5, None), (None, "length")):  # "acde", then the limit
            run.queue.put_nowait(event)
        while await run._next(request=None):
            pass
        return run

    run = asyncio.run(main())
    assert (run.finish, run.text, run.tokens, cancelled) == ("stop", "a", [1, 3, 4], [run.seq])


# OpenAI's documented request shapes (the API reference's chat and completions parameters, as the `openai` client
# sends them), each with what this server answers: "ok" (served as OpenAI serves it) or the status of its one-line
# refusal. docs/reference.md (Serving over HTTP) lists the same table.
USER = {"role": "user", "content": "Hello"}
OPENAI_SHAPES = [
    ("chat: text content", "chat", {"messages": [USER]}, "ok"),
    ("chat: content as text parts", "chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]}, "ok"),
    ("chat: system, developer, assistant turns", "chat", {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Be kind."}, USER,
        {"role": "assistant", "content": "Hi"}, USER]}, "ok"),
    ("chat: a name on a message", "chat", {"messages": [{**USER, "name": "ann"}]}, "ok"),
    ("chat: max_completion_tokens", "chat", {"messages": [USER], "max_completion_tokens": 3, "max_tokens": None}, "ok"),
    ("chat: stop as a string", "chat", {"messages": [USER], "stop": "\n"}, "ok"),
    ("chat: n 1, seed, user", "chat", {"messages": [USER], "n": 1, "seed": 3, "user": "u1"}, "ok"),
    ("chat: penalties 0, response_format text, tool_choice none", "chat", {
        "messages": [USER], "presence_penalty": 0, "frequency_penalty": 0, "response_format": {"type": "text"},
        "tool_choice": "none"}, "ok"),
    ("chat: logprobs false", "chat", {"messages": [USER], "logprobs": False}, "ok"),
    ("chat: stream with include_usage", "chat", {"messages": [USER], "stream": True,
                                                 "stream_options": {"include_usage": True}}, "ok"),
    ("completions: a batch of one prompt", "completions", {"prompt": ["Hello"]}, "ok"),
    ("completions: token ids", "completions", {"prompt": [40, 41, 42]}, "ok"),
    ("chat: an image part", "chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400),
    ("chat: role tool", "chat", {"messages": [USER, {"role": "tool", "content": "42", "tool_call_id": "c1"}]}, 400),
    ("chat: an unknown role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat: tools", "chat", {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("chat: presence_penalty 1", "chat", {"messages": [USER], "presence_penalty": 1.0}, 400),
    ("chat: logit_bias", "chat", {"messages": [USER], "logit_bias": {"50": 10}}, 400),
    ("chat: response_format json_object", "chat", {"messages": [USER], "response_format": {"type": "json_object"}}, 400),
    ("chat: n 2", "chat", {"messages": [USER], "n": 2}, 400),
    ("chat: max_tokens -1", "chat", {"messages": [USER], "max_tokens": -1}, 400),
    ("completions: two prompts", "completions", {"prompt": ["a", "b"]}, 400),
]


def test_openai_request_shapes(server):
    """Every shape of OPENAI_SHAPES through the `openai` client: the served ones answer as OpenAI's do (a streamed
    include_usage ends in a chunk of no choices with the usage), the refused ones in one 400 naming the parameter."""
    import openai

    c = server.client()
    seen = []
    for name, route, args, want in OPENAI_SHAPES:
        api = c.chat.completions if route == "chat" else c.completions
        kw = {"model": server.model, "max_tokens": 4, "temperature": 0, **args}
        kw = {k: v for k, v in kw.items() if v is not None}
        try:
            out = api.create(**kw)
            if kw.get("stream"):
                chunks = list(out)
                assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1, name
            else:
                assert out.usage.completion_tokens >= 1, name
            got = "ok"
        except openai.APIStatusError as e:
            got = e.status_code
            assert e.body["type"] == "invalid_request_error" and e.body["message"], name
            assert "None" not in e.body["message"], (name, e.body["message"])
        seen.append(f"{name}: {got}")
        assert got == want, (name, got, want)
    print("\n".join(seen))
    # llama.cpp's server tests' malformed messages (its test_invalid_chat_completion_req, as data): each one 400
    for messages in (None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
                     [{"role": "system", "content": "test"}, {}]):
        body = json.dumps({"model": server.model, "messages": messages, "max_tokens": 2}).encode()
        req = urllib.request.Request(server.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "messages", messages
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=[USER], max_tokens=-1)
    assert e.value.body["message"] == "max_tokens must be >= 1, got -1"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert "messages[0].role must be one of system, developer, user, assistant, got 'wizard'" in e.value.body["message"]
