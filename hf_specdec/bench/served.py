"""``transformers serve`` (transformers' OpenAI-compatible server) as a process to test and measure against: started on
a model folder, waited for, sent chat completions over HTTP, stopped by its process id.

Used by ``tests/test_serve.py`` (an attached folder served: answers equal plain greedy decoding) and
``benchmarks/serve.py`` (served against direct calls). Needs the serving extras: ``pip install -e ".[serve]"``.

Example:
    >>> with TransformersServer("./my-model", trust_remote_code=True) as server:  # doctest: +SKIP
    ...     answer = server.complete([{"role": "user", "content": "Hi"}], max_tokens=32)
    ...     text = answer["choices"][0]["message"]["content"]
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


class TransformersServer:
    """``python -m transformers.cli.transformers serve FOLDER`` on 127.0.0.1, a port the server picks (``--port 0``:
    no race for a free port), the model loaded at start (the server listens only once it is), ``--trust-remote-code``
    when asked (the folder's ``custom_generate/`` then decodes). ``env`` is added to the server's environment (e.g.
    ``HF_SPECDEC_LOG_CALLS=1``: one line per hf_specdec call in :attr:`log`). Requests are greedy
    (``temperature: 0``) unless the call says otherwise."""

    def __init__(self, folder, trust_remote_code: bool = False, env: dict | None = None, log=None,
                 ready_timeout: float = 240, extra_args: tuple[str, ...] = ()):
        self.folder = str(folder)
        if log is None:
            handle, log = tempfile.mkstemp(prefix="transformers-serve-", suffix=".log")
            os.close(handle)
        self.log = Path(log)
        self.command = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.folder, "--host",
                        "127.0.0.1", "--port", "0", *([] if _cuda() else ["--device", "cpu"]), *extra_args]
        if trust_remote_code:
            self.command.append("--trust-remote-code")
        self.env = {**os.environ, "HF_HUB_DISABLE_UPDATE_CHECK": "1", **(env or {})}
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None
        self.base: str | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> TransformersServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.monotonic()
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env)
        try:
            self.base = self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    def _wait_ready(self, t0: float) -> str:
        while time.monotonic() - t0 < self.ready_timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.process.returncode}:\n{self.log_tail()}")
            found = re.search(r"Uvicorn running on (http://[0-9.]+:[0-9]+)", self.log.read_text(errors="replace"))
            if found:
                try:
                    with urllib.request.urlopen(f"{found.group(1)}/health", timeout=2) as response:
                        if response.status == 200:
                            return found.group(1)
                except OSError:
                    pass
            time.sleep(0.25)
        raise TimeoutError(f"transformers serve not ready after {self.ready_timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM by process id (the server's model process exits with it), SIGKILL after 20 s."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""

    def _body(self, messages, max_tokens: int, **fields) -> dict:
        return {"model": self.folder, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}

    def _post(self, body: dict):
        request = urllib.request.Request(f"{self.base}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=600)

    def complete(self, messages, max_tokens: int = 64, **fields) -> dict:
        """One chat completion (OpenAI's response JSON)."""
        with self._post(self._body(messages, max_tokens, **fields)) as response:
            return json.loads(response.read())

    def stream(self, messages, max_tokens: int = 64, **fields) -> tuple[str, str | None, dict | None]:
        """One streamed chat completion (server-sent events): its text, finish reason and usage."""
        parts, finish, usage = [], None, None
        body = self._body(messages, max_tokens, stream=True, stream_options={"include_usage": True}, **fields)
        with self._post(body) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                for choice in chunk.get("choices", []):
                    parts.append(choice.get("delta", {}).get("content") or "")
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        return "".join(parts), finish, usage


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
