"""llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) on the embedded GGUF file, started
on a free loopback port for the tests that drive the server backend, and stopped after them."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LlamaServer:
    url: str  # the API's base URL, /v1 included
    model: Path  # the GGUF file it serves
    process: subprocess.Popen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(model: Path, log: Path, n_ctx: int = 2048, start_timeout: float = 180.0) -> Iterator[LlamaServer]:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"the server tests need llama-cpp-python[server] ({e}): run `make setup`") from e
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", "2", "--verbose", "false"]
    with log.open("w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {process.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama_cpp.server did not answer within {start_timeout}s") from None
                time.sleep(0.5)
        yield LlamaServer(url, model, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
