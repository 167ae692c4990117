"""How `blockdraft serve` runs and stops: HTTP (uvicorn) in a background thread, the engine worker
in the main thread (where its CPU kernels run fastest: docs/serving.md), and a graceful shutdown.

On SIGTERM (or Ctrl-C) the server stops admitting: new requests and /health get 503. The requests
it has accepted, waiting ones included, decode on for up to the grace period; what is left then is
cut, each with its text so far and finish_reason "abort". Every client gets a complete answer (a
stream its last chunk and `[DONE]`), then HTTP closes and the process exits 0. A second signal cuts
at once. If the engine worker dies instead, the exception ends the process (non-zero)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from fastapi import FastAPI

from ..errors import BlockdraftError

DEFAULT_GRACE_SECONDS = 10.0
# Once every request has its answer, how long HTTP may take to send them before it closes anyway
# (a client that stopped reading must not hold the process).
HTTP_CLOSE_SECONDS = 5.0


def serve_in_main_thread(app: FastAPI, host: str, port: int, banner: str,
                         shutdown_grace: float = DEFAULT_GRACE_SECONDS) -> None:
    """Serve an app made with `worker_thread=False` until SIGTERM or Ctrl-C (then shut down
    gracefully within `shutdown_grace` seconds), or until the HTTP server stops."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=HTTP_CLOSE_SECONDS))
    http = threading.Thread(target=server.run, name="blockdraft-http", daemon=True)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise BlockdraftError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.05)
    print(banner, file=sys.stderr, flush=True)
    scheduler = app.state.scheduler
    signals = []

    def on_signal(signum, frame):
        # a signal handler: flags only (scheduler.drain takes no lock), and os.write, not print
        signals.append(signum)
        first = len(signals) == 1
        scheduler.drain(shutdown_grace if first else 0.0)
        note = (f"shutting down: finishing requests for up to {shutdown_grace:g} s (signal again to cut now)"
                if first else "cutting the requests left now")
        os.write(2, f"blockdraft serve: {note}\n".encode())

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        scheduler.run()  # until drained or cut, or until the HTTP server stops (its lifespan closes it)
    finally:
        server.should_exit = True
        http.join(timeout=HTTP_CLOSE_SECONDS + 5)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals:
        print("blockdraft serve: stopped", file=sys.stderr, flush=True)
