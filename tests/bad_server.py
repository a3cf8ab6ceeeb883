"""An OpenAI-compatible server that answers badly, one way per base URL (`http://HOST:PORT/<way>/v1`),
for the tests of what `decoder=server` makes of a reply: each way is what a broken, misconfigured or
hostile server could send."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "bad-model"
MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "me"}]}
FLOOD_BYTES = 50 * 1024 * 1024  # the 50 MB reply to a few tokens
TRICKLE_S = 0.5  # a byte every half second: each read is quick, the reply never ends


def completion(max_tokens: int, text: object = "ok", **usage: object) -> dict:
    """A well-formed reply, with `text` and the `usage` fields given replaced."""
    counts = {"prompt_tokens": 12, "completion_tokens": min(2, max_tokens), **usage}
    choice = {"index": 0, "text": text, "finish_reason": "length"}
    return {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [choice], "usage": counts}


class Handler(BaseHTTPRequestHandler):
    server: BadServer

    def log_message(self, format: str, *args: object) -> None:
        pass  # the tests' output is theirs

    def do_GET(self) -> None:
        way, _, path = self.path.strip("/").partition("/")
        if path != "v1/models":
            return self.send(404, b"not found")
        if way != "models":
            return self.send(200, json.dumps(MODELS).encode())
        self.server.arrived.setdefault(way, time.monotonic())
        self.send(200, json.dumps({"object": "list", "data": [{"id": 5, "owned_by": "me"}]}).encode())

    def do_POST(self) -> None:
        way, _, path = self.path.strip("/").partition("/")
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if path != "v1/completions" or way not in WAYS:
            return self.send(404, b"not found")
        self.server.arrived.setdefault(way, time.monotonic())
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client hung up: as it should
            WAYS[way](self, asked["max_tokens"])

    def send(self, status: int, body: bytes, length: int | None = None, kind: str = "application/json") -> None:
        """Headers (Content-Length `length`, the body's own by default) and the body."""
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def reply(self, data: dict) -> None:
        self.send(200, json.dumps(data).encode())

    def flood(self, status: int, head: bytes) -> None:
        """`head` then filler up to FLOOD_BYTES, sent as fast as the client reads."""
        self.send(status, head, length=FLOOD_BYTES)
        for sent in range(len(head), FLOOD_BYTES, 65536):
            self.wfile.write(b"a" * min(65536, FLOOD_BYTES - sent))

    def trickle(self, max_tokens: int) -> None:
        """Spaces (JSON allows them before a value) one at a time, without end."""
        self.send(200, b"", length=FLOOD_BYTES)
        while True:
            self.wfile.write(b" ")
            self.wfile.flush()
            time.sleep(TRICKLE_S)


def cut_short(h: Handler, max_tokens: int) -> None:
    body = json.dumps(completion(max_tokens)).encode()
    h.send(200, body[:20], length=len(body))  # the connection closes mid-body


WAYS: dict[str, Callable[[Handler, int], None]] = {
    "good": lambda h, n: h.reply(completion(n, prompt_tokens_details={"cached_tokens": 4})),
    "models": lambda h, n: h.reply(completion(n)),  # its model list is the bad part
    "cut_connection": cut_short,
    "cut_json": lambda h, n: h.send(200, json.dumps(completion(n)).encode()[:20]),
    "null_text": lambda h, n: h.reply(completion(n, text=None)),
    "null_tokens": lambda h, n: h.reply(completion(n, completion_tokens=None)),
    "text_tokens": lambda h, n: h.reply(completion(n, prompt_tokens="12")),
    "negative_tokens": lambda h, n: h.reply(completion(n, completion_tokens=-120)),
    "html": lambda h, n: h.send(200, b"<!DOCTYPE html><html><body>Welcome</body></html>", kind="text/html"),
    "trickle": Handler.trickle,
    "oversized": lambda h, n: h.flood(200, b'{"choices": [{"text": "'),
    "error_flood": lambda h, n: h.flood(500, b"internal error\n"),
}


class BadServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.arrived: dict[str, float] = {}  # way -> when its first bad reply was asked for

    def url(self, way: str) -> str:
        return f"http://127.0.0.1:{self.server_port}/{way}/v1"


@contextlib.contextmanager
def bad_server() -> Iterator[BadServer]:
    server = BadServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
