"""A real-engine fleet: N llama.cpp instances on loopback, with real prefix caches.

Used by ``prefixroute demo --engine llama-cpp``, ``bench/llama_cpp_fleet.py`` and the
``llama_cpp`` integration test. Each instance is one process running
:mod:`prefixroute.engines.llama_cpp_server` (llama-cpp-python's OpenAI server plus
``/health`` and prefix-cache ``/metrics``) on a tiny random-weight Llama model written by
:mod:`prefixroute.engines.tiny_gguf`, with one CPU thread and llama-cpp-python's RAM
prompt cache, so that each instance holds several prefixes and really skips their
prefill. Docs: docs/LLAMA_CPP.md.

The engine runs under a Python that has the ``llama-cpp`` extra
(``pip install 'prefixroute[llama-cpp]'``: llama-cpp-python[server], gguf, numpy). That is
this interpreter when the extra is installed here, or the one named by the environment
variable ``PREFIXROUTE_LLAMA_PYTHON`` (e.g. a separate virtualenv; prefixroute itself need
not be installed there: the two engine-side files are run as scripts).

Token counts below are the byte-level model's: one token per UTF-8 byte of the prompt
(a space is one token), plus a BOS token.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from prefixroute.demo.processes import Child, ProcessGroup
from prefixroute.engines.tiny_gguf import TinyModelSpec
from prefixroute.workloads.shared_prefix import CHARS_PER_TOKEN, SharedPrefixWorkload, WorkloadRequest

if TYPE_CHECKING:
    from prefixroute.core.config import RoutingStrategy
    from prefixroute.demo.loadgen import RequestResult
    from prefixroute.demo.report import RunSummary

__all__ = [
    "ENV_PYTHON", "EngineUnavailable", "LlamaCppSettings", "LlamaCppFleet", "find_engine_python",
    "generate_model", "engine_command", "state_bytes_per_token", "chat_prompt", "prompt_tokens",
    "shared_prefix_workload", "completion_requests", "MODEL_NAME", "SECOND_MODEL_NAME", "DEMO_DEFAULTS", "StrategyRun",
    "run_strategy", "describe_workload", "run_demo_strategy",
]

#: Environment variable naming the Python that has the ``llama-cpp`` extra.
ENV_PYTHON = "PREFIXROUTE_LLAMA_PYTHON"
#: The model name the instances serve (``/v1/models``) and the requests carry.
MODEL_NAME = "prefixroute-tiny-llama"
#: The second model's name in a two-model fleet (``LlamaCppFleet(..., models=2)``): the
#: same shape, other weights (another seed), another GGUF file.
SECOND_MODEL_NAME = "prefixroute-tiny-llama-b"
SERVER_SCRIPT = Path(__file__).with_name("llama_cpp_server.py")
GGUF_SCRIPT = Path(__file__).with_name("tiny_gguf.py")
_ENGINE_MODULES = ("llama_cpp", "gguf", "numpy", "uvicorn", "fastapi", "sse_starlette", "pydantic_settings")
_INSTALL_HINT = (
    "llama.cpp is not available: install the extra (pip install -e '.[llama-cpp]'; it compiles "
    f"llama.cpp, 8-12 minutes on 2 cores the first time) or set {ENV_PYTHON} to a Python that has it"
)


class EngineUnavailable(RuntimeError):
    """No Python with llama-cpp-python[server], gguf and numpy was found."""


def _has_engine_modules(python: str) -> bool:
    # Not realpath: every virtualenv's python links to the same base interpreter.
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        return all(importlib.util.find_spec(m) is not None for m in _ENGINE_MODULES)
    code = ("import importlib.util as u, sys; "
            f"sys.exit(0 if all(u.find_spec(m) for m in {_ENGINE_MODULES!r}) else 1)")
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_engine_python(explicit: str | None = None) -> str:
    """The Python that runs the engines: ``explicit``, else ``$PREFIXROUTE_LLAMA_PYTHON``,
    else this interpreter.

    Raises:
        EngineUnavailable: the chosen Python lacks llama-cpp-python[server], gguf or numpy.
    """
    python = explicit or os.environ.get(ENV_PYTHON) or sys.executable
    if not _has_engine_modules(python):
        raise EngineUnavailable(f"{_INSTALL_HINT} ({python} lacks one of {', '.join(_ENGINE_MODULES)})")
    return python


def state_bytes_per_token(spec: TinyModelSpec) -> int:
    """Bytes of llama.cpp state (the KV cache, float16 K and V) per cached token:
    ``layers x 2 x width x 2`` (1,024 for the default 2 x 128 model). llama.cpp adds a few
    kilobytes per saved state (logits of the last token, headers)."""
    return spec.layers * 2 * spec.width * 2


@dataclass(frozen=True, slots=True)
class LlamaCppSettings:
    """How each llama.cpp instance runs.

    Attributes:
        threads: CPU threads per instance for prefill and decode (llama.cpp ``n_threads``
            and ``n_threads_batch``).
        n_ctx: context size, tokens (the longest prompt + output an instance takes).
        n_batch: prompt tokens per ``llama_decode`` call.
        cache_tokens: capacity of each instance's RAM prompt cache in tokens of saved
            state; converted to llama-cpp-python's ``cache_size`` bytes with
            :func:`state_bytes_per_token`. 0 disables the RAM cache (then an instance
            reuses only the prefix of the prompt it served last).
        model: the tiny model to generate when no ``model_path`` is given.
        model_path: an existing GGUF to serve instead (any llama.cpp model works; token
            counts then follow its tokenizer).
        ready_timeout_s: how long one instance may take to load and listen, seconds.
    """

    threads: int = 1
    n_ctx: int = 16384
    n_batch: int = 512
    cache_tokens: int = 32768
    model: TinyModelSpec = TinyModelSpec()
    model_path: str | None = None
    ready_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.n_ctx < 16:
            raise ValueError(f"n_ctx must be >= 16 tokens, got {self.n_ctx}")
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {self.n_batch}")
        if self.cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {self.cache_tokens}")

    @property
    def cache_bytes(self) -> int:
        """llama-cpp-python's ``cache_size``: ``cache_tokens`` x bytes per token, bytes."""
        return self.cache_tokens * state_bytes_per_token(self.model)


def generate_model(path: str | Path, spec: TinyModelSpec, python: str) -> Path:
    """Write the tiny model with ``python`` (which must have gguf and numpy); returns ``path``.

    Raises:
        RuntimeError: the generator failed; the message has its output.
    """
    cmd = [python, str(GGUF_SCRIPT), str(path), "--layers", str(spec.layers), "--width", str(spec.width),
           "--heads", str(spec.heads), "--context", str(spec.context), "--seed", str(spec.seed)]
    if spec.ffn is not None:
        cmd += ["--ffn", str(spec.ffn)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"model generation failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
    return Path(path)


def engine_command(python: str, model_path: str | Path, settings: LlamaCppSettings, instance_id: str,
                   port: int = 0, host: str = "127.0.0.1", verbose: bool = False, alias: str = MODEL_NAME) -> list[str]:
    """The argv of one instance serving ``model_path`` as ``alias`` (prints
    ``prefixroute-llamacpp listening on URL`` when ready)."""
    cmd = [python, str(SERVER_SCRIPT), "--model", str(model_path), "--model-alias", alias,
           "--host", host, "--port", str(port), "--threads", str(settings.threads),
           "--n-ctx", str(settings.n_ctx), "--n-batch", str(settings.n_batch),
           "--cache-bytes", str(settings.cache_bytes), "--instance-id", instance_id]
    if verbose:
        cmd.append("--verbose")
    return cmd


class LlamaCppFleet:
    """``instances`` llama.cpp servers on loopback; a context manager that stops them.

    Use::

        with LlamaCppFleet(3) as fleet:
            urls = fleet.start()      # model generated, every instance ready
            ...                       # prefixroute serve --backend URL ...

    Instances start in parallel, each on a free port, all in ``procs`` (a
    :class:`~prefixroute.demo.processes.ProcessGroup`, own or given), so they are stopped
    (SIGTERM, then SIGKILL) on exit, on error and on Ctrl-C. A model generated here lives
    in a temporary directory removed by :meth:`close`.

    ``models=2``: a fleet serving two models, so that routing by ``model`` runs on a real
    engine: two GGUF files generated from the same shape with different seeds, served as
    :data:`MODEL_NAME` and :data:`SECOND_MODEL_NAME`; instance ``i`` serves model
    ``i % 2`` (:attr:`served`).

    Raises:
        EngineUnavailable: from the constructor, when no Python has llama.cpp.
    """

    def __init__(self, instances: int, settings: LlamaCppSettings = LlamaCppSettings(),
                 procs: ProcessGroup | None = None, python: str | None = None, models: int = 1) -> None:
        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances}")
        if models not in (1, 2) or (models == 2 and settings.model_path):
            raise ValueError("models must be 1, or 2 with a generated model (no model_path)")
        self.instances = instances
        self.models = models
        self._second: Path | None = None
        self.settings = settings
        self.python = find_engine_python(python)
        self._own_procs = procs is None
        self.procs = procs if procs is not None else ProcessGroup()
        self.children: list[Child] = []
        self._tmp: str | None = None
        self.model_path: Path | None = Path(settings.model_path) if settings.model_path else None

    @property
    def urls(self) -> list[str]:
        """Base URLs of the running instances, in instance order."""
        return [c.url for c in self.children]

    @property
    def served(self) -> dict[str, str]:
        """Instance URL -> the model name it serves."""
        return {c.url: self.alias(i) for i, c in enumerate(self.children)}

    def alias(self, i: int) -> str:
        """The model name instance ``i`` serves."""
        return SECOND_MODEL_NAME if self.models == 2 and i % 2 else MODEL_NAME

    def prepare_model(self) -> Path:
        """Generate the tiny model(s) once (no-op when a model path was given)."""
        if self.model_path is None:
            self._tmp = tempfile.mkdtemp(prefix="prefixroute-llamacpp-")
            self.model_path = generate_model(Path(self._tmp) / "tiny-llama.gguf", self.settings.model, self.python)
        if self.models == 2 and self._second is None:
            spec = replace(self.settings.model, seed=self.settings.model.seed + 1)
            self._second = generate_model(Path(self._tmp or tempfile.mkdtemp(prefix="prefixroute-llamacpp-"))
                                          / "tiny-llama-b.gguf", spec, self.python)
        return self.model_path

    def start(self) -> list[str]:
        """Start every instance (cold caches) and wait until each listens; returns their URLs.

        Raises:
            prefixroute.demo.processes.StartupError: an instance failed or timed out.
        """
        model = self.prepare_model()
        cmds = [engine_command(self.python, self._second if self.alias(i) == SECOND_MODEL_NAME else model,
                               self.settings, f"instance-{i}", alias=self.alias(i)) for i in range(self.instances)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.instances) as pool:
            futures = [pool.submit(self.procs.start, f"llama.cpp-{i}", [], self.settings.ready_timeout_s, 1, cmd)
                       for i, cmd in enumerate(cmds)]
            self.children = [f.result() for f in futures]
        return self.urls

    def stop(self) -> None:
        """Stop the instances (the model file is kept for the next :meth:`start`)."""
        for c in self.children:
            self.procs.stop(c)
        self.children = []

    def close(self) -> None:
        """Stop the instances and delete a generated model."""
        self.stop()
        if self._own_procs:
            self.procs.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            self.model_path = None
            self._second = None

    def __enter__(self) -> "LlamaCppFleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- workload ------------------------------------------------------------------------------

def chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text the tiny model's chat template makes of ``messages`` (string contents):
    ``<|role|>\\n`` + content + ``\\n`` per message, then ``<|assistant|>\\n``. The same
    rendering as the router's chat key
    (:func:`prefixroute.core.routing_text.render_chat_text`)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def prompt_tokens(text: str) -> int:
    """Prompt tokens of ``text`` for the byte-level tiny model: UTF-8 bytes + 1 (BOS)."""
    return len(text.encode("utf-8")) + 1


def shared_prefix_workload(groups: int, prefix_tokens: int, question_tokens: int, output_tokens: int,
                           seed: int = 0) -> SharedPrefixWorkload:
    """The shared-prefix workload sized in the byte-level model's tokens.

    :class:`~prefixroute.workloads.shared_prefix.SharedPrefixWorkload` counts tokens of the
    emulated engine (4 characters each); its texts are ASCII, so a prefix of
    ``prefix_tokens`` byte tokens is ``prefix_tokens / 4`` of its tokens.
    """
    return SharedPrefixWorkload(
        groups=groups,
        prefix_tokens=max(1, round(prefix_tokens / CHARS_PER_TOKEN)),
        question_tokens=max(1, round(question_tokens / CHARS_PER_TOKEN)),
        output_tokens=output_tokens,
        model=MODEL_NAME,
        seed=seed,
    )


def completion_requests(workload: SharedPrefixWorkload, count: int) -> Iterator[WorkloadRequest]:
    """The first ``count`` requests of ``workload`` as ``/v1/completions`` bodies.

    Each chat request becomes a raw prompt (:func:`chat_prompt`), so the router keys on and
    the engine prefills exactly the same text; ``prompt_tokens`` is the byte-level count.
    Greedy sampling (``temperature`` 0): the same outputs for every strategy.
    """
    for r in workload.requests(count):
        prompt = chat_prompt(r.body["messages"])
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": r.body["max_tokens"], "temperature": 0.0}
        yield replace(r, body=body, prompt_tokens=prompt_tokens(prompt))


# -- one measured run ------------------------------------------------------------------------

#: ``prefixroute demo --engine llama-cpp`` defaults for the flags whose emulated-fleet
#: defaults do not fit three one-thread CPU engines (see docs/LLAMA_CPP.md for the sizing).
DEMO_DEFAULTS: dict[str, Any] = {
    "instances": 3,
    "groups": 16,
    "prefix_tokens": 4000,  # byte tokens: about 1 s of cold prefill at one thread
    "kv_capacity_tokens": 40000,  # RAM prompt cache of each instance: ~9 saved prompts of ~4,100 tokens
    "users": 2,  # the machine has 2 cores; more users would measure CPU contention
    "duration": 60.0,
    "prefix_length": 2048,  # characters: shorter than the 4,000-character prefixes, so questions stay out of the key
}


@dataclass
class StrategyRun:
    """What one strategy's run on a fresh llama.cpp fleet produced.

    Attributes:
        results: every request's result, in order of completion.
        summary: SPEC §7's figures (times in real seconds).
        counters: the instances' ``/metrics`` counters, summed (see docs/LLAMA_CPP.md).
        urls: the instances' base URLs, in ``instance_share`` order.
    """

    results: "list[RequestResult]"
    summary: "RunSummary"
    counters: dict[str, float]
    urls: list[str]


async def run_strategy(
    strategy: "RoutingStrategy",
    workload: SharedPrefixWorkload,
    *,
    requests: int,
    users: int,
    duration_s: float,
    instances: int = 3,
    settings: LlamaCppSettings = LlamaCppSettings(),
    prefix_length: int = 4096,
    concurrency_threshold: int = 12,
    seed: int = 0,
    procs: ProcessGroup | None = None,
    python: str | None = None,
    on_done: "Callable[[RequestResult], None] | None" = None,
    timeout_s: float = 300.0,
) -> StrategyRun:
    """Start a fresh llama.cpp fleet (cold caches) and the router, send ``workload``, measure.

    Sends the first ``requests`` requests of ``workload`` as ``/v1/completions`` (streamed)
    through ``prefixroute serve --strategy STRATEGY`` with ``users`` closed-loop users, no
    new request after ``duration_s`` seconds; then reads every instance's ``/metrics`` and
    stops the router and the fleet.

    Args:
        strategy: a :class:`~prefixroute.core.config.RoutingStrategy`.
        settings: how each instance runs (threads, context, RAM prompt-cache size, model).
        prefix_length: PrefixLength (characters) when ``strategy`` is PREFIX_AWARE.
        concurrency_threshold: ConcurrencyThreshold when ``strategy`` is PREFIX_AWARE or
            CACHE_AWARE (whose InstanceCacheTokens is ``settings.cache_tokens``).
        procs: the process group to start children in (a new one when ``None``).
        python: the engine's Python (default: :func:`find_engine_python`).
        on_done: called after each request (progress display).
        timeout_s: per-request timeout, seconds.

    Returns:
        A :class:`StrategyRun`: per-request results, the SPEC §7 summary in **real**
        seconds (``cache_hit_rate`` = ``vllm:prefix_cache_hits_total /
        vllm:prefix_cache_queries_total`` of the instances: cached / prompt tokens), the
        summed counters and the instance URLs.

    Raises:
        EngineUnavailable: no Python with llama.cpp.
        prefixroute.demo.processes.StartupError: an instance or the router did not start.
    """
    import asyncio

    from prefixroute.core.config import RoutingStrategy
    from prefixroute.demo.loadgen import run_closed_loop
    from prefixroute.demo.report import scrape_counters, summarize

    names = ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "llamacpp:prompt_tokens_evaluated_total", "llamacpp:prompt_eval_seconds_total",
             "llamacpp:ram_cache_restores_total", "llamacpp:requests_total"]
    own = procs is None
    group = procs if procs is not None else ProcessGroup()
    fleet = LlamaCppFleet(instances, settings, group, python)
    try:
        urls = await asyncio.to_thread(fleet.start)
        serve = ["serve", "--port", "0", "--admin-port", "0", "--strategy", strategy.cli_name, "--seed", str(seed)]
        if strategy is RoutingStrategy.PREFIX_AWARE:
            serve += ["--prefix-length", str(prefix_length), "--concurrency-threshold", str(concurrency_threshold)]
        elif strategy.value == "CACHE_AWARE":
            # The router's view of each instance's cache as large as the engine's RAM prompt
            # cache. InstanceCacheTokens counts tokens of 4 characters (config.py); this
            # model's tokens are 1 character, hence the division.
            serve += ["--concurrency-threshold", str(concurrency_threshold),
                      "--instance-cache-tokens", str(max(1024, settings.cache_tokens // CHARS_PER_TOKEN))]
        for u in urls:
            serve += ["--backend", u]
        router = await asyncio.to_thread(group.start, "router", serve)
        try:
            results, wall = await run_closed_loop(
                router.url + "/v1/completions", completion_requests(workload, requests), users, duration_s,
                on_done, timeout_s=timeout_s,
            )
            counters = await scrape_counters(urls, names)
        finally:
            group.stop(router)
        summary = summarize(strategy.value, results, wall, 1.0, urls,
                            counters["vllm:prefix_cache_hits_total"], counters["vllm:prefix_cache_queries_total"])
        return StrategyRun(results, summary, counters, urls)
    finally:
        fleet.close()
        if own:
            group.close()


@dataclass(frozen=True)
class _Described:
    text: str

    def describe(self) -> str:
        return self.text


def describe_workload(groups: int, prefix_tokens: int, question_tokens: int, output_tokens: int, seed: int,
                      requests: int | None, settings: LlamaCppSettings) -> str:
    """The ``workload`` field of SPEC §7's JSON for a llama.cpp run (tokens are byte tokens)."""
    m = settings.model
    return (
        f"shared-prefix on llama.cpp groups={groups} prefix_tokens={prefix_tokens} "
        f"question_tokens={question_tokens} output_tokens={output_tokens} seed={seed} "
        f"requests={requests if requests else 'unlimited'} (byte-level tokens); engine: llama-cpp-python, "
        f"tiny random llama {m.layers}x{m.width}, {settings.threads} thread(s), n_ctx={settings.n_ctx}, "
        f"RAM prompt cache {settings.cache_tokens} tokens ({settings.cache_bytes} bytes) per instance"
    )


async def run_demo_strategy(args: Any, strategy: Any, procs: ProcessGroup, on_done: Any) -> tuple[Any, list, Any]:
    """``prefixroute demo --engine llama-cpp``: one strategy on a fresh fleet, from the demo's flags.

    ``--prefix-tokens``/``--question-tokens`` are byte-level tokens, ``--kv-capacity-tokens``
    the RAM prompt cache of each instance in tokens; ``--time-scale`` does not apply (times
    are real seconds). Returns ``(workload, results, summary)`` as the emulated path does.
    """
    settings = LlamaCppSettings(cache_tokens=args.kv_capacity_tokens)
    workload = shared_prefix_workload(args.groups, args.prefix_tokens, args.question_tokens, args.output_tokens,
                                      args.seed)
    requests = getattr(args, "requests", None)
    run = await run_strategy(
        strategy, workload, requests=requests or 10**9, users=args.users, duration_s=args.duration,
        instances=args.instances, settings=settings, prefix_length=args.prefix_length,
        concurrency_threshold=args.concurrency_threshold, seed=args.seed, procs=procs, on_done=on_done,
    )
    desc = describe_workload(args.groups, args.prefix_tokens, args.question_tokens, args.output_tokens, args.seed,
                             requests, settings)
    return _Described(desc), run.results, run.summary
