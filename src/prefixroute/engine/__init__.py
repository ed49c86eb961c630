"""The emulated vLLM engine: one instance with automatic prefix caching, no GPU.

Sans-I/O model (no asyncio, no clock; safe to import from the simulator):

* :mod:`~prefixroute.engine.tokenizer` — the 4-byte-chunk tokenizer;
* :mod:`~prefixroute.engine.kvcache` — :class:`PrefixCache`, chained block hashes, LRU;
* :mod:`~prefixroute.engine.model` — :class:`EngineConfig` and the step-time model;
* :mod:`~prefixroute.engine.core` — :class:`EngineCore`, the continuous-batching scheduler.

I/O drivers (import them explicitly; they pull in aiohttp):

* :mod:`~prefixroute.engine.server` — the OpenAI-compatible HTTP server, real time (its
  ``/metrics``: :mod:`~prefixroute.engine.metrics`);
* :mod:`~prefixroute.engine.cli` — ``prefixroute emulate``.
"""

from prefixroute.engine.core import EngineCore, EngineStats, RequestOutput, RequestRejected, StepOutput
from prefixroute.engine.kvcache import PrefixCache, prompt_block_hashes
from prefixroute.engine.model import EngineConfig, step_duration
from prefixroute.engine.tokenizer import TokenizedPrompt, tokenize

__all__ = [
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "PrefixCache",
    "RequestOutput",
    "RequestRejected",
    "StepOutput",
    "TokenizedPrompt",
    "prompt_block_hashes",
    "step_duration",
    "tokenize",
]
