"""The server's input limits and metrics on a tiny random target: request fields validated and each
unsupported one named, tiny temperatures greedy, stop strings capped to what the engine's stop
window finds, the body size checked before the body is read, tokenizing off the event loop,
metric labels from a fixed set and always valid Prometheus text, and the API key kept out of vLLM's
command line."""

import json
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from test_server_support import MODEL, ServerThread, chat_body, metric, tiny_dir  # noqa: F401  (a fixture)

prometheus = pytest.importorskip("prometheus_client")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    from blockdraft.cli import load_engine

    return load_engine(str(tiny_dir), "none", "cpu")


@pytest.fixture(scope="module")
def server(engine):
    from blockdraft.serving.server import create_app

    with ServerThread(create_app(engine, MODEL, max_body_bytes=64 * 1024)) as srv:
        yield srv


def post(srv, body, chat=True, **kw):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def test_each_unsupported_field_is_named_and_off_values_are_accepted(server):
    body = {**chat_body("Hi", 4), "logprobs": True, "tools": [{"type": "function"}], "top_k": 5}
    r = post(server, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "logprobs" and err["type"] == "invalid_request_error"
    for name in ("'logprobs'", "'tools'", "'top_k'"):
        assert name in err["message"]
    # what clients send for "off" is not a request for the feature
    off = {**chat_body("Hi", 4), "logprobs": False, "tools": [], "presence_penalty": 0, "logit_bias": {},
           "user": "someone", "n": 1}
    assert post(server, off).status_code == 200


@pytest.mark.parametrize("field,value", [("temperature", True), ("temperature", "0.5"), ("max_tokens", 4.0),
                                         ("stream", 1), ("seed", -1), ("top_p", 0), ("n", 2)])
def test_fields_are_typed_strictly(server, field, value):
    r = post(server, {**chat_body("Hi", 4), field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_tiny_temperature_decodes_greedily(server):
    greedy = post(server, chat_body("Tell me a joke.", 16))
    tiny = post(server, chat_body("Tell me a joke.", 16, temperature=1e-40))  # logits / T: inf, then NaN
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]
    # the request itself asks for greedy decoding, whatever the engine makes of a tiny temperature
    from blockdraft.serving.api import parse_body

    assert parse_body(chat_body("Hi", 4, temperature=1e-40), True, MODEL).sampling_temperature == 0.0
    assert parse_body(chat_body("Hi", 4, temperature=1e-5), True, MODEL).sampling_temperature == 1e-5


def test_stop_strings_are_capped_at_what_the_stop_window_finds(server):
    cap = 31  # bytes of UTF-8 (docs/serving.md): the engine's stop window is 32 tokens
    ok = post(server, chat_body("Hi", 4, stop=["x" * cap]))
    assert ok.status_code == 200
    for stop in ("x" * (cap + 1), "\u00e9" * (cap // 2 + 1)):  # bytes, not characters
        r = post(server, chat_body("Hi", 4, stop=[stop]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    from blockdraft.serving.api import MAX_STOP_BYTES

    assert MAX_STOP_BYTES == cap


def test_the_engine_finds_a_stop_string_of_the_cap_and_misses_a_longer_one(engine):
    """Why the cap is what it is: the engine's Stopper looks in the last 32 tokens' text. With one
    byte a token (the worst case), a stop of MAX_STOP_BYTES bytes is found on its last token; one
    of 33 never is, and generation would run to max_tokens."""
    from blockdraft.decoding.engine import GenerationConfig
    from blockdraft.decoding.state import Stopper
    from blockdraft.serving.api import MAX_STOP_BYTES

    tok = engine.target.tokenizer
    one_byte = [tok.convert_tokens_to_ids(c) for c in "abcdefgh"]
    assert all(len(tok.decode([i])) == 1 for i in one_byte)
    rng = random.Random(0)
    tokens = [rng.choice(one_byte) for _ in range(200)]  # no 31 letters of it occur twice
    text = tok.decode(tokens)
    target = SimpleNamespace(stop_token_ids=[], tokenizer=tok)

    def stops_after(stop: str):
        stopper = Stopper(target, GenerationConfig(stop_strings=(stop,)), budget=10_000)
        for n, t in enumerate(tokens, 1):
            stopper.clip([t])
            if stopper.finish_reason == "stop":
                return n
        return None

    at_cap = text[50:50 + MAX_STOP_BYTES]
    assert stops_after(at_cap) == 50 + MAX_STOP_BYTES
    assert stops_after(text[50:50 + 33]) is None


def _raw(srv, request: bytes, then: bytes = b"", timeout: float = 10) -> bytes:
    """Send raw HTTP (and `then`), return the status line's part of what comes back."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        if then:
            s.sendall(then)
        return s.recv(4096)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    # a Content-Length over the limit: 413 without a byte of the body sent
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 16777216\r\n\r\n")
    assert _raw(server, head).startswith(b"HTTP/1.1 413")
    # no Content-Length (chunked): 413 once the chunks pass the limit, before the body ends
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n" % (40 * 1024) + b" " * (40 * 1024) + b"\r\n"
    assert _raw(server, head, chunk * 2).startswith(b"HTTP/1.1 413")
    r = post(server, {**chat_body("Hi", 4), "messages": [{"role": "user", "content": "x" * 70000}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_the_chat_template_runs_off_the_event_loop(server, engine, monkeypatch):
    """A slow template (here: 1.5 s) holds up its own request only: /health answers meanwhile."""
    real = engine.target.encode_messages

    def slow(messages):
        time.sleep(1.5)
        return real(messages)

    monkeypatch.setattr(engine.target, "encode_messages", slow)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(server, chat_body("Hi", 4))))
    t.start()
    time.sleep(0.3)  # the request is in its template now
    began = time.time()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert time.time() - began < 0.5
    t.join()
    assert result["r"].status_code == 200


def test_metric_labels_come_from_a_fixed_set_whatever_the_paths(engine):
    """Paths chosen by unauthenticated clients (quotes, braces, newlines, thousands of them) must
    neither break the Prometheus text nor grow the series: they all count as endpoint="other"."""
    from prometheus_client.parser import text_string_to_metric_families

    from blockdraft.serving.server import create_app

    routes = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}

    with ServerThread(create_app(engine, MODEL, api_key="k")) as srv:
        odd = ['/v1/x"y', "/a{b}c", "/new%0Aline", "/back\\slash", "/v1/models/../x"] + [f"/p{i}" for i in range(200)]
        with httpx.Client(base_url=srv.url) as c:
            for path in odd:
                assert c.get(path).status_code == 401
            assert c.get("/nothing", headers={"authorization": "Bearer k"}).status_code == 404
            text = c.get("/metrics", headers={"authorization": "Bearer k"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # raises on a malformed text
    samples = [s for s in families["blockdraft_requests"].samples if s.name == "blockdraft_requests_total"]
    assert {s.labels["endpoint"] for s in samples} <= routes | {"other"}
    counts = {(s.labels["endpoint"], s.labels["status"]): s.value for s in samples}
    assert counts[("other", "401")] == len(odd) and counts[("other", "404")] == 1
    assert metric(text, "blockdraft_queue_depth") == 0 and "blockdraft_batch_size_bucket" in text


def test_each_app_counts_in_a_registry_of_its_own(engine):
    from blockdraft.serving.server import create_app

    with ServerThread(create_app(engine, MODEL)) as one, ServerThread(create_app(engine, MODEL)) as two:
        assert httpx.get(one.url + "/v1/models").status_code == 200
        models = 'blockdraft_requests_total{endpoint="/v1/models",status="200"}'
        assert metric(httpx.get(one.url + "/metrics").text, models) == 1
        assert metric(httpx.get(two.url + "/metrics").text, models) == 0


def test_serve_with_the_vllm_backend_passes_the_api_key_in_the_environment(tmp_path):
    """vLLM reads VLLM_API_KEY as it reads --api-key; a command line is readable by every user of
    the machine (ps, /proc), so the key goes in the environment and the printed command shows ***."""
    from conftest import tiny_draft, tiny_target

    from blockdraft.models.checkpoint import save_draft

    target = tiny_target()
    target.model.save_pretrained(tmp_path / "target")
    save_draft(tiny_draft(target, block_size=4), tmp_path / "draft")
    fake_python = tmp_path / "python"  # stands in for vLLM's: shows what it was given
    fake_python.write_text('#!/bin/sh\necho "argv: $*"\necho "key: $VLLM_API_KEY"\n')
    fake_python.chmod(0o755)
    blockdraft = str(Path(sys.executable).parent / "blockdraft")
    ran = subprocess.run([blockdraft, "serve", "--backend", "vllm", "--target", str(tmp_path / "target"), "--draft",
                          str(tmp_path / "draft"), "--api-key", "s3cr3t-k3y", "--device", "cpu", "--vllm-python",
                          str(fake_python)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    printed, argv, key = ran.stdout.splitlines()[-3:]
    assert "s3cr3t-k3y" not in printed and "VLLM_API_KEY=***" in printed
    assert argv.startswith("argv: -m vllm.entrypoints.openai.api_server") and "s3cr3t-k3y" not in argv
    assert "--api-key" not in argv and key == "key: s3cr3t-k3y"


def test_openai_shaped_errors_for_bad_json_and_unknown_routes(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and json.loads(r.text)["error"]["message"]
