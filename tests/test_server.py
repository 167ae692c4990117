"""The OpenAI-compatible server on the real SmolLM2 (slow: loads the model; runs in CI), driven by
the official `openai` client and raw HTTP on a free loopback port."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from blockdraft.cli import load_engine, main
from blockdraft.decoding.engine import GenerationConfig

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from blockdraft.serving.server import create_app  # noqa: E402  (needs fastapi, like the two above)
from test_server_support import ServerThread  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
PROMPTS = ["What is the capital of France?", "List three colors.", "Write a haiku about rain.",
           "Say hello in Spanish."]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(2)
    return load_engine(MODEL, None, "cpu")  # with the bundled drafter


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, MODEL)) as srv:
        yield srv


def client(srv, key="unused"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def cli_json(capsys, *args) -> dict:
    assert main(["generate", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_openai_client_text_equals_blockdraft_generate(server, capsys):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    prompt = PROMPTS[0]
    want = cli_json(capsys, "--prompt", prompt, "--max-new-tokens", "24")
    msgs = [{"role": "user", "content": prompt}]
    resp = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    assert resp.choices[0].message.content == want["text"]
    assert resp.choices[0].finish_reason == want["finish_reason"]
    assert resp.usage.completion_tokens == want["num_new_tokens"]
    assert resp.model_extra["blockdraft"]["tau"] >= 1.0
    streamed = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want["text"]
    assert chunks[-1].usage.completion_tokens == want["num_new_tokens"]

    want_raw = cli_json(capsys, "--prompt", "The three primary colors are", "--raw", "--max-new-tokens", "16")
    resp = c.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=16, temperature=0)
    assert resp.choices[0].text == want_raw["text"]
    streamed = c.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=16,
                                    temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want_raw["text"]


def test_stop_strings_and_seeded_sampling(server, engine):
    c = client(server)
    msgs = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0).choices[0].message.content
    assert "5" in full
    stop = "5"
    cut = full[: full.index(stop)]
    resp = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, stop=[stop])
    assert resp.choices[0].message.content == cut and resp.choices[0].finish_reason == "stop"
    streamed = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == cut
    a, b = (c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0.8, top_p=0.9,
                                      seed=7).choices[0].message.content for _ in range(2))
    assert a == b  # a seed makes sampling reproducible


def test_32_concurrent_requests_all_correct(server, engine):
    expected = {}
    for p in PROMPTS:
        ids = engine.target.encode_messages([{"role": "user", "content": p}])
        expected[p] = engine.generate(ids, GenerationConfig(max_new_tokens=8)).text

    async def burst():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        calls = [ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % 4]}],
                                            max_tokens=8, temperature=0) for i in range(32)]
        return await asyncio.gather(*calls)

    before = httpx.get(server.url + "/metrics").text
    results = asyncio.run(burst())
    for i, r in enumerate(results):
        assert r.choices[0].message.content == expected[PROMPTS[i % 4]]
    after = httpx.get(server.url + "/metrics").text
    # the requests were decoded together: steps of more than one sequence ran
    steps = _metric(after, "blockdraft_batch_size_count") - _metric(before, "blockdraft_batch_size_count")
    one = 'blockdraft_batch_size_bucket{le="1.0"}'
    alone = _metric(after, one) - _metric(before, one)
    assert steps > 0 and alone < steps
    assert _metric(after, "blockdraft_step_tokens_count") == _metric(after, "blockdraft_batch_size_count")
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["queue_depth"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'blockdraft_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert "blockdraft_tau_count" in metrics and "blockdraft_request_latency_seconds_bucket" in metrics


def test_disconnect_mid_stream_frees_the_engine(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 2000, "temperature": 0, "stream": True}
    before = httpx.get(server.url + "/metrics").text
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break  # got real text: now walk away
    deadline = time.time() + 30
    while httpx.get(server.url + "/health").json()["running"]:
        assert time.time() < deadline, "the abandoned request kept the engine"
        time.sleep(0.1)
    assert _metric(httpx.get(server.url + "/metrics").text, "blockdraft_cancelled_total") == \
        _metric(before, "blockdraft_cancelled_total") + 1
    r = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
    assert r.choices[0].message.content


def _metric(text: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


BAD = [  # (endpoint, body, status, param)
    ("chat", b"{not json", 400, None),
    ("chat", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("chat", {"model": MODEL}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "max_tokens"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}, 400,
     "max_tokens"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}, 400,
     "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, 400,
     "temperature"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
     "temperature"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "n"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}, 400, "stop"),
    ("chat", [1, 2, 3], 400, None),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [5, 10**9]}, 400, None),
    ("completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD)
def test_bad_input_gets_openai_shaped_4xx(server, endpoint, body, status, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(server.url + path, headers={"content-type": "application/json"}, timeout=60, **kw)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_unknown_route_and_method_are_4xx(server):
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/chat/completions").status_code == 405
    assert "error" in httpx.get(server.url + "/v1/nothing").json()


class GatedEngine:
    """The real engine, but its batch waits at a gate before each decode step: a request that
    is running stays running until the test opens the gate, whatever the text's length."""

    def __init__(self, engine):
        self.engine, self.target, self.draft = engine, engine.target, engine.draft
        self.gate = threading.Event()

    def batch(self, *args):
        batch = self.engine.batch(*args)
        step = batch.step

        def gated_step():
            self.gate.wait(timeout=120)
            return step()

        batch.step = gated_step
        return batch


def test_api_key_enforced_and_queue_refuses_beyond_capacity(engine):
    gated = GatedEngine(engine)
    with ServerThread(create_app(gated, MODEL, api_key="sekrit", max_queue=1, max_batch=1)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
            for path in ("/v1/models", "/metrics"):
                resp = httpx.get(srv.url + path, headers=headers)
                assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(srv, "wrong").models.list()
        good = client(srv, "sekrit")
        assert good.models.list().data[0].id == MODEL

        # one running, one waiting (max_queue=1): the next is refused with 429, not dropped
        auth = {"authorization": "Bearer sekrit"}
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=auth, timeout=60) as first:
            assert first.status_code == 200
            while not httpx.get(srv.url + "/health").json()["running"]:
                time.sleep(0.05)
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=auth, timeout=60) as second:
                assert second.status_code == 200
                while httpx.get(srv.url + "/health").json()["queue_depth"] < 1:
                    time.sleep(0.05)
                third = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, headers=auth)
                assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_error"
        gated.gate.set()
        # both clients left: the engine is free again
        deadline = time.time() + 30
        while (h := httpx.get(srv.url + "/health").json())["running"] or h["queue_depth"]:
            assert time.time() < deadline
            time.sleep(0.1)
        assert good.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0).choices[0].text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_with_key_from_environment():
    port = _free_port()
    env = {**os.environ, "BLOCKDRAFT_API_KEY": "k3y"}
    proc = subprocess.Popen([sys.executable, "-m", "blockdraft.cli", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "serve did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                      temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_client_leaving_mid_batch_does_not_disturb_the_others(engine):
    """Four streaming requests decoded together; one client walks away after its first text.
    The other three get exactly their texts alone, and the batch empties."""
    prompts = PROMPTS[1:4]
    expected = [engine.generate(engine.target.encode_messages([{"role": "user", "content": p}]),
                                GenerationConfig(max_new_tokens=24)).text for p in prompts]
    with ServerThread(create_app(engine, MODEL, max_batch=4)) as srv:
        async def run():
            ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)

            async def full(p):
                stream = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                          max_tokens=24, temperature=0, stream=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

            async def leaver():
                stream = await ac.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=500,
                    temperature=0, stream=True)
                async for ch in stream:
                    if ch.choices and ch.choices[0].delta.content:
                        break
                await stream.close()

            return await asyncio.gather(leaver(), *(full(p) for p in prompts))

        texts = asyncio.run(run())[1:]
        assert texts == expected
        deadline = time.time() + 30
        while httpx.get(srv.url + "/health").json()["running"]:
            assert time.time() < deadline, "the abandoned request stayed in the batch"
            time.sleep(0.1)
        assert _metric(httpx.get(srv.url + "/metrics").text, "blockdraft_cancelled_total") == 1


def test_bench_serve_runs_settings_side_by_side(engine, tmp_path):
    from blockdraft.evaluation.bench_serve import plot_levels, run_levels

    with ServerThread(create_app(engine, MODEL, max_batch=1)) as one, \
            ServerThread(create_app(engine, MODEL, max_batch=2)) as two:
        servers = [("max_batch=1", one.url), ("max_batch=2", two.url)]
        levels = run_levels(servers, PROMPTS, [1, 2], 2, 60.0, 8, MODEL, log=lambda row: None,
                            temperatures=(0.0, 1.0))
    assert [(v.setting, v.concurrency, v.temperature) for v in levels] == \
        [(s, c, t) for t in (0.0, 1.0) for c in (1, 2) for s in ("max_batch=1", "max_batch=2")]
    for v in levels:
        assert v.requests == 2 and 2 <= v.tokens <= 16 and v.tokens_per_second > 0
        assert 0 < v.ttft_p50 <= v.ttft_p99 and v.tpot_p50 is not None
    assert levels[0].ratio == 1.0 and levels[2].ratio == 1.0 and levels[4].ratio == 1.0
    plot_levels(levels, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_bench_serve_command_starts_its_servers(tmp_path, capsys):
    """The command as users run it: a server process per setting, a table, the JSON and a plot."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "serve.json"
    assert main(["bench-serve", "--dataset", str(prompts), "--concurrency", "2", "--max-batch", "2",
                 "--draft", "bundled,none", "--temperature", "0,1", "--requests", "2", "--max-new-tokens", "6",
                 "--json", str(out), "--plot", str(tmp_path / "serve.png")]) == 0
    table = capsys.readouterr().out
    assert "draft=bundled,max_batch=2" in table and "draft=none,max_batch=2" in table
    levels = json.loads(out.read_text())["levels"]
    assert [(v["setting"], v["temperature"]) for v in levels] == \
        [(f"draft={d},max_batch=2", t) for t in (0.0, 1.0) for d in ("bundled", "none")]
    assert all(v["requests"] == 2 and v["tokens"] > 0 for v in levels)
    assert (tmp_path / "serve.png").stat().st_size > 0
