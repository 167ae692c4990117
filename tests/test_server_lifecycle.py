"""The server's lifecycle on a tiny random target: SIGTERM in a real process (stop admitting,
finish or cut within the grace period, a last event and `[DONE]` for every stream, exit 0), a
failure kept to the request that caused it, a dead worker seen by /health, and clients that leave
before their first byte. Run as a script (`python tests/test_server_lifecycle.py serve ...`), this
file serves the tiny target with every decode step slowed down, so that requests are still running
when the test sends its signal."""

import signal
import sys
import threading
import time

import httpx
import pytest

from test_server_support import (CONTEXT, MODEL, ServerProcess, ServerThread, chat_body, free_port, metric,
                                 read_sse, serve_command, tiny_dir, wait_for)  # noqa: F401  (tiny_dir: a fixture)

LONG = 150  # tokens: 3 s at 20 ms a step, so a request is still running when the signal comes


class SlowEngine:
    """The real engine, its decode steps slowed to `seconds` each (prefills are not)."""

    def __init__(self, engine, seconds: float):
        self.engine, self.target, self.draft, self.seconds = engine, engine.target, engine.draft, seconds

    def batch(self, *args):
        batch = self.engine.batch(*args)
        step = batch.step

        def slow_step():
            time.sleep(self.seconds)
            return step()

        batch.step = slow_step
        return batch


class GatedEngine:
    """The real engine, but each decode step waits for the gate: what runs stays running until the
    test opens it. `poison`: a step of a batch holding a prompt with this token id raises, as a bug
    that one request's input triggers would. `batches`: how many batches it makes before its
    `batch` raises too (None: no limit), to kill the worker from where no request is to blame."""

    def __init__(self, engine, poison: int | None = None, batches: int | None = None):
        self.engine, self.target, self.draft = engine, engine.target, engine.draft
        self.gate = threading.Event()
        self.poison, self.batches = poison, batches

    def batch(self, *args):
        if self.batches is not None:
            if self.batches == 0:
                raise RuntimeError("no batch for you")
            self.batches -= 1
        batch = self.engine.batch(*args)
        step = batch.step

        def gated_step():
            assert self.gate.wait(timeout=120), "the test never opened the gate"
            if self.poison is not None and any(self.poison in s.prompt_ids for s in batch.sequences):
                raise RuntimeError("a poisoned prompt")
            return step()

        batch.step = gated_step
        return batch


def serve_slowly(target: str, port: int, grace: float, step_seconds: float) -> None:
    """This file as a script: `blockdraft serve`'s main-thread server over a SlowEngine."""
    from blockdraft.cli import load_engine
    from blockdraft.serving.lifecycle import serve_in_main_thread
    from blockdraft.serving.server import create_app

    engine = SlowEngine(load_engine(target, "none", "cpu"), step_seconds)
    app = create_app(engine, MODEL, lookup=False, worker_thread=False)
    serve_in_main_thread(app, "127.0.0.1", port, "serving slowly", shutdown_grace=grace)


def slow_server(tiny_dir, grace: float) -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, __file__, "serve", str(tiny_dir), str(port), str(grace), "0.02"], port)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    from blockdraft.cli import load_engine

    return load_engine(str(tiny_dir), "none", "cpu")


def alone(engine, prompt: str, max_tokens: int, chat: bool = True, lookup: bool = True) -> str:
    from blockdraft.decoding.engine import GenerationConfig

    t = engine.target
    ids = t.encode_messages([{"role": "user", "content": prompt}]) if chat else t.tokenizer(prompt)["input_ids"]
    return engine.generate(ids, GenerationConfig(max_new_tokens=max_tokens, lookup=lookup)).text


class Clients:
    """A streaming chat client and a non-streaming completion client, each in a thread."""

    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens, self.results = url, max_tokens, {}
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._reply)]
        for t in self.threads:
            t.start()

    def _stream(self):
        body = chat_body("Tell me a story.", self.max_tokens, stream=True)
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as r:
            self.results["stream"] = (r.status_code, read_sse(r.iter_lines(), chat=True))

    def _reply(self):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": self.max_tokens, "temperature": 0}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
        self.results["reply"] = (r.status_code, r.json())

    def join(self):
        for t in self.threads:
            t.join(timeout=120)
        return self.results["stream"], self.results["reply"]


def test_sigterm_stops_admitting_finishes_what_runs_and_exits_0(tiny_dir, engine):
    with slow_server(tiny_dir, grace=60) as srv:
        clients = Clients(srv.url, LONG)
        wait_for(lambda: httpx.get(srv.url + "/health").json()["running"] == 2, what="both requests running")
        srv.signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, what="/health to say 503")
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "draining" and "shutting down" in health["reason"]
        late = httpx.post(srv.url + "/v1/chat/completions", json=chat_body("Hi", 4), timeout=30)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        (status, streamed), (reply_status, reply) = clients.join()
        assert status == 200 and streamed.done and streamed.error is None
        assert streamed.finish_reason == "length" and streamed.usage["completion_tokens"] == LONG
        assert streamed.text == alone(engine, "Tell me a story.", LONG, lookup=False)
        assert reply_status == 200 and reply["choices"][0]["finish_reason"] == "length"
        assert reply["choices"][0]["text"] == alone(engine, "Once upon a time", LONG, chat=False, lookup=False)
        assert srv.wait(timeout=60) == 0, srv.output()


def test_sigterm_past_the_grace_period_cuts_requests_with_abort(tiny_dir):
    with slow_server(tiny_dir, grace=1) as srv:
        clients = Clients(srv.url, CONTEXT - 200)  # 40 s at 20 ms a step: far beyond the grace period
        wait_for(lambda: httpx.get(srv.url + "/health").json()["running"] == 2, what="both requests running")
        signalled = time.time()
        srv.signal(signal.SIGTERM)
        (status, streamed), (reply_status, reply) = clients.join()
        assert time.time() - signalled < 20
        assert status == 200 and streamed.done and streamed.finish_reason == "abort"
        assert 0 < streamed.usage["completion_tokens"] < CONTEXT - 200 and streamed.text
        assert reply_status == 200 and reply["choices"][0]["finish_reason"] == "abort"
        assert 0 < reply["usage"]["completion_tokens"] < CONTEXT - 200
        assert srv.wait(timeout=60) == 0, srv.output()


def test_serve_command_exits_0_on_sigterm_and_a_second_signal_cuts_at_once(tiny_dir):
    port = free_port()
    with ServerProcess(serve_command(tiny_dir, port, "--shutdown-grace", "600"), port) as srv:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": CONTEXT - 200, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is decoding
            srv.signal(signal.SIGTERM)
            time.sleep(0.5)  # two signals at once may arrive as one
            srv.signal(signal.SIGTERM)  # the second: do not wait the 600 s
            streamed = read_sse(lines, chat=False)
        assert streamed.done and streamed.finish_reason in ("abort", "length")
        assert srv.wait(timeout=60) == 0, srv.output()
        assert "stopped" in srv.output()


def test_a_failing_step_fails_only_the_request_that_caused_it(engine):
    """Four requests in one batch; a step with the poisoned one raises (the first step that holds
    it holds all four). The poisoned request gets an error; the other three their exact texts (as
    alone), and the server goes on."""
    from blockdraft.serving.server import create_app

    poison = 4242
    gated = GatedEngine(engine, poison=poison)
    prompts = ["The sea is", "My favourite colour", "In the beginning"]
    expected = [alone(engine, p, 40, chat=False) for p in prompts]
    with ServerThread(create_app(gated, MODEL, max_batch=4)) as srv:
        results = {}

        def post(name, prompt):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0}
            results[name] = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

        def accepted():
            health = httpx.get(srv.url + "/health").json()
            return health["running"] + health["queue_depth"]

        ids = engine.target.tokenizer("Poison")["input_ids"] + [poison]
        threads = [threading.Thread(target=post, args=(i, p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        wait_for(lambda: accepted() == 3, what="three requests")
        threads.append(threading.Thread(target=post, args=("poisoned", ids)))
        threads[-1].start()  # the last: the step that fails holds all four
        wait_for(lambda: accepted() == 4, what="the poisoned request")
        gated.gate.set()
        for t in threads:
            t.join(timeout=60)
        assert results["poisoned"].status_code == 500
        assert "poisoned prompt" in results["poisoned"].json()["error"]["message"]
        assert [results[i].json()["choices"][0]["text"] for i in range(3)] == expected
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 200 and health.json()["running"] == 0
        assert metric(httpx.get(srv.url + "/metrics").text, "blockdraft_failed_total") == 1
        again = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": prompts[0], "max_tokens": 40,
                                                              "temperature": 0}, timeout=60)
        assert again.json()["choices"][0]["text"] == expected[0]


@pytest.mark.parametrize("where", ["admission", "delivery"])
def test_an_exception_admitting_or_delivering_fails_only_that_request(engine, monkeypatch, where):
    """A request whose text stream raises (when it is made: admission; when it gets tokens:
    delivery) fails alone; the worker and the other requests go on."""
    from blockdraft.serving import scheduler
    from blockdraft.serving.server import create_app

    class Fragile(scheduler.TextStream):
        def __init__(self, tokenizer, stop_strings=()):
            super().__init__(tokenizer, stop_strings)
            if where == "admission" and "\u2620" in self.stop_strings:
                raise UnicodeError("cannot stream this")

        def push(self, tokens):
            if where == "delivery" and "\u2620" in self.stop_strings:
                raise UnicodeError("cannot stream this")
            return super().push(tokens)

    monkeypatch.setattr(scheduler, "TextStream", Fragile)
    expected = alone(engine, "Hello there", 30)
    with ServerThread(create_app(engine, MODEL, max_batch=4)) as srv:
        results = {}

        def post(name, **extra):
            results[name] = httpx.post(srv.url + "/v1/chat/completions", json=chat_body("Hello there", 30, **extra),
                                       timeout=30)

        threads = [threading.Thread(target=post, args=("bad",), kwargs={"stop": ["\u2620"]}),
                   threading.Thread(target=post, args=("good",))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results["bad"].status_code == 500 and "cannot stream this" in results["bad"].json()["error"]["message"]
        assert results["good"].json()["choices"][0]["message"]["content"] == expected
        post("after")
        assert results["after"].json()["choices"][0]["message"]["content"] == expected
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"


# the worker thread ends with the exception, as it should: loud, in the thread's excepthook
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_is_reported_by_health_and_refuses_requests(engine):
    """A failure outside any request (here: no new batch can be made after a failed step) ends
    the worker; the request in flight gets an error, /health says 503 with the reason, and new
    requests are refused with 503 instead of waiting for ever."""
    from blockdraft.serving.server import create_app

    gated = GatedEngine(engine, poison=4242, batches=1)
    gated.gate.set()
    with ServerThread(create_app(gated, MODEL)) as srv:
        body = {"model": MODEL, "prompt": [1, 2, 4242], "max_tokens": 20, "temperature": 0}
        failed = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert failed.status_code == 500
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "no batch for you" in health.json()["reason"]
        refused = httpx.post(srv.url + "/v1/chat/completions", json=chat_body("Hi", 4), timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"


def test_a_client_leaving_before_its_first_byte_frees_its_place(engine):
    """A non-streaming request in the batch and a streaming one in the queue: both clients give up
    before a byte of their answer. The first leaves the batch after the current step, the second
    the queue at once."""
    from blockdraft.serving.server import create_app

    gated = GatedEngine(engine)
    with ServerThread(create_app(gated, MODEL, max_batch=1)) as srv:
        def give_up(body):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))

        long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": CONTEXT - 200, "temperature": 0}
        waiter = threading.Thread(target=give_up, args=({**long, "stream": True},))
        running = threading.Thread(target=give_up, args=(long,))
        running.start()
        wait_for(lambda: httpx.get(srv.url + "/health").json()["running"] == 1, what="the first to run")
        waiter.start()
        wait_for(lambda: httpx.get(srv.url + "/health").json()["queue_depth"] == 1, what="the second to wait")
        running.join()
        waiter.join()
        # both noticed while the batch was still stuck in its step (the gate is closed)
        wait_for(lambda: metric(httpx.get(srv.url + "/metrics").text, "blockdraft_cancelled_total") == 2,
                 timeout=10, what="both cancellations")
        assert httpx.get(srv.url + "/health").json()["queue_depth"] == 0
        gated.gate.set()
        wait_for(lambda: httpx.get(srv.url + "/health").json()["running"] == 0, timeout=10,
                 what="the batch to empty")


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve_slowly(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
