"""One llama.cpp instance: llama-cpp-python's OpenAI server plus prefix-cache metrics.

Runs ``llama_cpp.server`` (the OpenAI-compatible FastAPI app of the ``llama-cpp-python``
package, which drives llama.cpp's C API) unchanged, and adds what a router needs and
llama-cpp-python does not export:

* ``GET /health``: 200 once the model is loaded (the router's default health check);
* ``GET /metrics``: Prometheus text with the prefix-cache counters under vLLM's names
  (so every prefixroute tool that reads vLLM reads this too) plus llama.cpp-specific ones;
* a ready line ``prefixroute-llamacpp listening on http://HOST:PORT`` on stdout once the
  socket is bound (``--port 0`` picks a free port).

**How cached tokens are measured.** llama-cpp-python keeps one llama.cpp context per
process. For each request, ``Llama.generate(prompt_tokens)`` first reuses the longest
common prefix between the prompt and the tokens already in that context (after
``_create_completion`` has restored, from the RAM prompt cache, the saved state whose
tokens share the longest prefix with the prompt, if that beats the live context), then
passes only the remaining prompt tokens to ``Llama.eval``, which hands them to
``llama_decode``, then samples the first token. This server wraps those three methods to
count, per request, the prompt tokens (``len(prompt_tokens)``, the same number as
``usage.prompt_tokens``) and the tokens passed to ``eval`` between the start of
``generate`` and its first ``sample``: the prompt tokens actually prefilled. Then

    cached prompt tokens = prompt tokens - prompt tokens evaluated

summed over requests, exported as ``vllm:prefix_cache_hits_total`` (cached) and
``vllm:prefix_cache_queries_total`` (prompt tokens), the same meaning as vLLM's counters,
so ``hits / queries`` is SPEC §6's cache-hit rate. The wrappers only observe: arguments
and results pass through untouched. (When a prompt is entirely cached, llama-cpp-python
re-evaluates its last token to refresh the logits; that token counts as evaluated.)

The other series: ``llamacpp:prompt_tokens_evaluated_total``, ``llamacpp:requests_total``
(requests whose prefill finished), ``llamacpp:prompt_eval_seconds_total`` (wall time from
``generate`` to its first ``sample``: prefill, seconds), ``llamacpp:ram_cache_restores_total``
(``Llama.load_state`` calls: a prefix restored from the RAM prompt cache),
``llamacpp:ram_cache_bytes`` (llama.cpp state bytes held by that cache),
``vllm:num_requests_running`` (0 or 1: llama-cpp-python serves one request at a time) and
``vllm:num_requests_waiting`` (generation requests received and not yet running).

This file imports only the standard library, ``llama_cpp`` and what its ``[server]`` extra
installs (``uvicorn``, ``fastapi``/``starlette``), so it runs under any Python that has
``llama-cpp-python[server]``, with or without prefixroute. The Prometheus text is written
by hand for that reason (``prometheus_client`` is not a dependency of that extra).
Checked against llama-cpp-python 0.3.x (the ``llama-cpp`` extra pins ``<0.4``): it exits
with a clear error if the methods it observes are missing.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import socket
import sys
import threading
import time
from typing import Any

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    # Run as a script: Python put this directory first on sys.path, where the router-side
    # llama_cpp.py would shadow the llama_cpp package.
    del sys.path[0]

__all__ = ["PrefillMeter", "main"]

#: Generation routes whose requests count as received (in flight) for ``num_requests_waiting``.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions"})


class PrefillMeter:
    """Per-process counters of prompt tokens and prompt tokens actually evaluated.

    Updated from the thread that runs the model (llama-cpp-python runs one request at a
    time under its own lock) and read from the event loop by ``/metrics``; a lock keeps
    each read consistent.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.prompt_tokens = 0
        self.evaluated_tokens = 0
        self.prompt_eval_s = 0.0
        self.ram_cache_restores = 0
        self.in_flight = 0  # generation HTTP requests received and not finished
        self.running = False
        # the request being prefilled: None outside prefill
        self._pending: list[Any] | None = None  # [prompt tokens, evaluated tokens, start time]

    def begin(self, prompt_tokens: int) -> None:
        """``generate`` started on a prompt of ``prompt_tokens`` tokens."""
        with self._lock:
            self._pending = [prompt_tokens, 0, time.perf_counter()]
            self.running = True

    def evaluated(self, n_tokens: int) -> None:
        """``eval`` was given ``n_tokens`` tokens (counted only during prefill)."""
        with self._lock:
            if self._pending is not None:
                self._pending[1] += n_tokens

    def first_sample(self) -> None:
        """``sample`` was called: the prefill of the pending request is over."""
        with self._lock:
            if self._pending is None:
                return
            prompt, evaluated, t0 = self._pending
            self._pending = None
            self.requests += 1
            self.prompt_tokens += prompt
            # eval never sees more than the prompt during prefill; clamp anyway so a
            # hit count can never go negative
            self.evaluated_tokens += min(evaluated, prompt)
            self.prompt_eval_s += time.perf_counter() - t0

    def end(self) -> None:
        """``generate`` finished (or was closed)."""
        with self._lock:
            self._pending = None
            self.running = False

    def restored(self) -> None:
        """``load_state``: a saved prefix was restored from the RAM prompt cache."""
        with self._lock:
            self.ram_cache_restores += 1

    def prometheus_text(self, ram_cache_bytes: int) -> str:
        """The ``/metrics`` body (Prometheus text format 0.0.4)."""
        with self._lock:
            cached = self.prompt_tokens - self.evaluated_tokens
            running = 1 if self.running else 0
            waiting = max(0, self.in_flight - running)
            series = [
                ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens of requests whose prefill finished.", self.prompt_tokens),
                ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens reused from the KV cache (prompt tokens - tokens evaluated).", cached),
                ("vllm:num_requests_running", "gauge", "Requests being processed (llama-cpp-python runs one at a time).", running),
                ("vllm:num_requests_waiting", "gauge", "Generation requests received and not yet running.", waiting),
                ("llamacpp:prompt_tokens_evaluated_total", "counter", "Prompt tokens passed to llama_decode during prefill.", self.evaluated_tokens),
                ("llamacpp:requests_total", "counter", "Requests whose prefill finished.", self.requests),
                ("llamacpp:prompt_eval_seconds_total", "counter", "Wall seconds from the start of generate to its first sample (prefill).", self.prompt_eval_s),
                ("llamacpp:ram_cache_restores_total", "counter", "Prefixes restored from the RAM prompt cache (Llama.load_state).", self.ram_cache_restores),
                ("llamacpp:ram_cache_bytes", "gauge", "llama.cpp state bytes held by the RAM prompt cache.", ram_cache_bytes),
            ]
        lines = []
        for name, kind, help_text, value in series:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name} {float(value)!r}")
        return "\n".join(lines) + "\n"


def install_meter(llama_cls: Any, meter: PrefillMeter) -> None:
    """Wrap ``generate``, ``eval``, ``sample`` and ``load_state`` of ``llama_cls`` to feed ``meter``.

    Raises:
        RuntimeError: a method is missing or ``generate`` is not a generator function
            (an incompatible llama-cpp-python).
    """
    for name in ("generate", "eval", "sample", "load_state"):
        if not callable(getattr(llama_cls, name, None)):
            raise RuntimeError(f"llama_cpp.Llama.{name} is missing: unsupported llama-cpp-python version")
    if not inspect.isgeneratorfunction(llama_cls.generate):
        raise RuntimeError("llama_cpp.Llama.generate is not a generator: unsupported llama-cpp-python version")
    orig_generate, orig_eval = llama_cls.generate, llama_cls.eval
    orig_sample, orig_load_state = llama_cls.sample, llama_cls.load_state

    @functools.wraps(orig_generate)
    def generate(self: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        tokens = list(tokens)
        meter.begin(len(tokens))
        try:
            return (yield from orig_generate(self, tokens, *args, **kwargs))
        finally:
            meter.end()

    @functools.wraps(orig_eval)
    def eval_(self: Any, tokens: Any) -> Any:
        meter.evaluated(len(tokens))
        return orig_eval(self, tokens)

    @functools.wraps(orig_sample)
    def sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        meter.first_sample()
        return orig_sample(self, *args, **kwargs)

    @functools.wraps(orig_load_state)
    def load_state(self: Any, state: Any) -> Any:
        meter.restored()
        return orig_load_state(self, state)

    llama_cls.generate, llama_cls.eval = generate, eval_
    llama_cls.sample, llama_cls.load_state = sample, load_state


def build_app(args: argparse.Namespace, meter: PrefillMeter) -> Any:
    """llama-cpp-python's app for ``args`` with ``/health``, ``/metrics`` and request counting."""
    import llama_cpp
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from starlette.responses import JSONResponse, PlainTextResponse

    install_meter(llama_cpp.Llama, meter)
    server = ServerSettings(host=args.host, port=args.port, interrupt_requests=False)
    model = ModelSettings(
        model=args.model,
        model_alias=args.model_alias,
        n_ctx=args.n_ctx,
        n_batch=args.n_batch,
        n_ubatch=args.n_batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        cache=args.cache_bytes > 0,
        cache_type="ram",
        cache_size=max(args.cache_bytes, 0),
        verbose=args.verbose,
        seed=args.seed,
    )
    app = create_app(server_settings=server, model_settings=[model])

    def ram_cache_bytes() -> int:
        from llama_cpp.server import app as server_app

        proxy = getattr(server_app, "_llama_proxy", None)
        llama = getattr(proxy, "_current_model", None)
        cache = getattr(llama, "cache", None)
        try:
            return int(cache.cache_size) if cache is not None else 0
        except Exception:  # a cache being mutated by the model thread: report nothing this time
            return 0

    @app.get("/health", include_in_schema=False)
    async def health() -> Any:
        return JSONResponse({"status": "ok", "instance": args.instance_id})

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Any:
        return PlainTextResponse(meter.prometheus_text(ram_cache_bytes()), media_type="text/plain; version=0.0.4")

    inner = app

    async def counting_app(scope: dict, receive: Any, send: Any) -> None:
        # Pure ASGI: the call lasts until the (possibly streamed) response is sent.
        if scope.get("type") == "http" and scope.get("path") in GENERATION_PATHS:
            meter.in_flight += 1
            try:
                await inner(scope, receive, send)
            finally:
                meter.in_flight -= 1
        else:
            await inner(scope, receive, send)

    return counting_app


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama_cpp_server",
        description="Serve a GGUF model with llama-cpp-python's OpenAI server plus /health and "
                    "prefix-cache /metrics (see the module docstring).",
    )
    p.add_argument("--model", required=True, help="path of the .gguf model")
    p.add_argument("--model-alias", default=None, help="the model name /v1/models reports (default: the path)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="listen port; 0 picks a free one (default: 0)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for prefill and decode (default: 1)")
    p.add_argument("--n-ctx", type=int, default=16384, help="context size, tokens (default: 16384)")
    p.add_argument("--n-batch", type=int, default=512, help="prompt tokens per llama_decode call (default: 512)")
    p.add_argument("--cache-bytes", type=int, default=256 << 20,
                   help="capacity of llama-cpp-python's RAM prompt cache, bytes of llama.cpp state; "
                        "0 disables it (then only the live context is reused) (default: 268435456)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--instance-id", default="llamacpp", help="a name reported by /health")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's and llama-cpp-python's own logs on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    """Load the model, bind the socket, print the ready line and serve until SIGTERM/SIGINT."""
    args = _parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("error: llama-cpp-python[server] is not installed in this Python "
              f"({sys.executable}); pip install 'prefixroute[llama-cpp]'", file=sys.stderr)
        return 2
    meter = PrefillMeter()
    try:
        app = build_app(args, meter)  # loads the model
    except (ImportError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    sock.set_inheritable(True)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    # Connections that arrive before uvicorn's loop starts wait in the listen backlog.
    print(f"prefixroute-llamacpp listening on http://{shown}:{port}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
