"""Configuration of precise mode: where each instance publishes its KV events.

Validated once at the edge (the YAML's ``KvEvents`` section, or ``prefixroute serve``'s
``--kv-events*`` flags) into an immutable :class:`KvEventsConfig`::

    KvEvents:
      BlockSize: 16                         # the engines' KV block size, tokens
      Instances:                            # per instance (its URL as in Instances)
        http://10.0.0.5:8000:
          Endpoint: tcp://10.0.0.5:5557     # vLLM --kv-events-config "endpoint"
          ReplayEndpoint: tcp://10.0.0.5:5558
      Discovery:                            # for every instance not listed above
        EndpointTemplate: tcp://{host}:5557 # {host} and {port}: the instance URL's
        ReplayEndpointTemplate: tcp://{host}:5558
        FromInfo: false                     # ask the instance's GET /info (prefixroute emulate)

An instance with neither an entry nor a discovery rule has no stream: it stays in
approximate mode.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefixroute.core.kvevents.stream import StreamSettings

#: Tokenizers shipped with prefixroute, named instead of a path (``--tokenizer tiny``):
#: :mod:`prefixroute.core.model_tokenizer` loads them.
BUNDLED_TOKENIZERS = ("tiny",)

__all__ = ["BUNDLED_TOKENIZERS", "KvEventsEndpoint", "KvEventsDiscovery", "KvEventsConfig", "check_zmq_endpoint"]

_SCHEMES = ("tcp://", "ipc://", "inproc://")


def check_zmq_endpoint(value: str, what: str) -> str:
    """``value`` if it is a ZeroMQ endpoint a subscriber can connect to, else ``ValueError``."""
    if not isinstance(value, str) or not value.startswith(_SCHEMES) or any(c.isspace() for c in value):
        raise ValueError(f"{what}: {value!r} is not a tcp://, ipc:// or inproc:// endpoint")
    if value.startswith("tcp://") and ("*" in value or ":" not in value[len("tcp://"):]):
        raise ValueError(f"{what}: {value!r} needs a host and a port to connect to (no '*')")
    return value


class KvEventsEndpoint(BaseModel):
    """Where one instance publishes.

    Attributes:
        endpoint: the PUB socket to connect to (``Endpoint``).
        replay_endpoint: the replay ROUTER socket (``ReplayEndpoint``), or ``None``.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    endpoint: str = Field(alias="Endpoint")
    replay_endpoint: str | None = Field(default=None, alias="ReplayEndpoint")

    @field_validator("endpoint")
    @classmethod
    def _v_endpoint(cls, v: str) -> str:
        return check_zmq_endpoint(v, "Endpoint")

    @field_validator("replay_endpoint")
    @classmethod
    def _v_replay(cls, v: str | None) -> str | None:
        return None if v is None else check_zmq_endpoint(v, "ReplayEndpoint")


def _template(v: str | None, what: str) -> str | None:
    if v is None:
        return None
    try:
        sample = v.format(host="h", port=1)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"{what}: {v!r} may use only {{host}} and {{port}} ({exc})") from None
    check_zmq_endpoint(sample, what)
    return v


class KvEventsDiscovery(BaseModel):
    """How to find the endpoints of instances not listed.

    Attributes:
        endpoint_template: ``EndpointTemplate``, e.g. ``tcp://{host}:5557`` (vLLM's
            default port on every engine host).
        replay_endpoint_template: ``ReplayEndpointTemplate``, or ``None``: no replay.
        from_info: ``FromInfo``: ask each instance's ``GET /info`` for its
            ``kv_events`` endpoints (``prefixroute emulate`` answers it); tried first.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    endpoint_template: str | None = Field(default=None, alias="EndpointTemplate")
    replay_endpoint_template: str | None = Field(default=None, alias="ReplayEndpointTemplate")
    from_info: bool = Field(default=False, alias="FromInfo")

    @field_validator("endpoint_template")
    @classmethod
    def _v_endpoint(cls, v: str | None) -> str | None:
        return _template(v, "EndpointTemplate")

    @field_validator("replay_endpoint_template")
    @classmethod
    def _v_replay(cls, v: str | None) -> str | None:
        return _template(v, "ReplayEndpointTemplate")

    @model_validator(mode="after")
    def _v_some(self) -> "KvEventsDiscovery":
        if self.endpoint_template is None and not self.from_info:
            raise ValueError("Discovery needs an EndpointTemplate or FromInfo: true")
        if self.replay_endpoint_template is not None and self.endpoint_template is None:
            raise ValueError("Discovery: ReplayEndpointTemplate needs an EndpointTemplate")
        return self


class KvEventsConfig(BaseModel):
    """Precise mode: subscribe to every instance's KV events (see the module docstring).

    Attributes:
        block_size: ``BlockSize``, 1-4,096: the engines' KV block size in tokens
            (vLLM: 16 on CUDA by default; llm-d's guides use 64). Events of another block
            size are ignored.
        topic: ``Topic``: the topic prefix subscribed to (vLLM's default, ``""``: all).
        instances: ``Instances``: instance URL -> :class:`KvEventsEndpoint`.
        discovery: ``Discovery``: :class:`KvEventsDiscovery` for the others, or ``None``.
        replay_timeout_s: ``ReplayTimeoutS``: longest wait for a replay's end, seconds.
        max_pending_messages: ``MaxPendingMessages``: live messages held during a replay.
        min_replay_interval_s: ``MinReplayIntervalS``: a gap sooner than this after the
            last replay resets the instance's state instead (a flooding publisher).
        receive_hwm: ``ReceiveHwm``: messages ZeroMQ queues per subscription before it
            drops (then a gap shows).
        shared_tier_max_blocks: ``SharedTierMaxBlocks``: most shared-tier blocks remembered.
        tokenizer: ``Tokenizer``: the engines' model tokenizer, ``tiny`` (bundled) or the
            path of a model directory or ``tokenizer.json``
            (:meth:`prefixroute.core.model_tokenizer.ModelTokenizer.load`); ``None``:
            the router follows the events (status, metrics) but cannot match requests
            against them, so ``CACHE_AWARE`` stays on its learned view.
        chat_template: ``ChatTemplate``: a Jinja chat template file replacing the
            tokenizer's (as vLLM's ``--chat-template``), or ``None``.
        tokenizer_cache_pieces: ``TokenizerCachePieces``: prompt pieces whose token ids
            and keys are remembered (:class:`prefixroute.core.precise_keys.RequestKeyer`).
        inline_tokenize_chars: ``InlineTokenizeChars``: most characters of new prompt
            text tokenized on a request's path (about 1 ms at 8,192); a request with more
            (the first to name a new document) is routed on the learned view while a
            thread tokenizes it for the next ones. ``null``: no limit. Applies to
            ``Matching: tokens``.
        matching: ``Matching``: how a request is matched against the blocks the events
            report. ``bytes`` (default): its prompt's bytes (the chat template applied)
            are walked against the held blocks' token ids rendered back to bytes
            (:mod:`prefixroute.core.kvevents.byte_index`), so no request is tokenized;
            it needs a tokenizer whose tokens render to exactly their text (byte-level
            BPE: GPT-2, Llama 3, Qwen, ``tiny``), checked at start, else ``tokens``.
            ``tokens``: each request is tokenized
            (:class:`prefixroute.core.precise_keys.RequestKeyer`).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    block_size: int = Field(default=16, alias="BlockSize", ge=1, le=4096)
    topic: str = Field(default="", alias="Topic")
    instances: dict[str, KvEventsEndpoint] = Field(default_factory=dict, alias="Instances")
    discovery: KvEventsDiscovery | None = Field(default=None, alias="Discovery")
    replay_timeout_s: float = Field(default=2.0, alias="ReplayTimeoutS", gt=0, le=600)
    max_pending_messages: int = Field(default=10_000, alias="MaxPendingMessages", ge=1, le=10_000_000)
    min_replay_interval_s: float = Field(default=1.0, alias="MinReplayIntervalS", ge=0, le=3600)
    receive_hwm: int = Field(default=100_000, alias="ReceiveHwm", ge=1, le=100_000_000)
    shared_tier_max_blocks: int = Field(default=10_000_000, alias="SharedTierMaxBlocks", ge=1)
    tokenizer: str | None = Field(default=None, alias="Tokenizer", min_length=1)
    chat_template: str | None = Field(default=None, alias="ChatTemplate", min_length=1)
    tokenizer_cache_pieces: int = Field(default=4096, alias="TokenizerCachePieces", ge=0, le=10_000_000)
    inline_tokenize_chars: int | None = Field(default=8192, alias="InlineTokenizeChars", ge=0)
    matching: Literal["bytes", "tokens"] = Field(default="bytes", alias="Matching")

    @field_validator("tokenizer")
    @classmethod
    def _v_tokenizer(cls, v: str | None) -> str | None:
        from pathlib import Path

        if v is None or v in BUNDLED_TOKENIZERS:
            return v
        path = Path(v)
        if not (path / "tokenizer.json").is_file() and not path.is_file():
            raise ValueError(f"Tokenizer: {v!r} is neither {' nor '.join(BUNDLED_TOKENIZERS)}, a tokenizer.json file "
                             f"nor a directory holding one")
        return v

    @field_validator("chat_template")
    @classmethod
    def _v_template(cls, v: str | None) -> str | None:
        from pathlib import Path

        if v is not None and not Path(v).is_file():
            raise ValueError(f"ChatTemplate: {v!r} is not a file")
        return v

    @field_validator("instances", mode="before")
    @classmethod
    def _v_instances(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        return {str(url).strip().rstrip("/"): e for url, e in v.items()}

    def endpoints_for(self, instance_url: str) -> KvEventsEndpoint | None:
        """The configured or templated endpoints of an instance; ``None`` when it has
        neither (``FromInfo`` discovery is the driver's: it needs a request)."""
        listed = self.instances.get(instance_url)
        if listed is not None:
            return listed
        d = self.discovery
        if d is None or d.endpoint_template is None:
            return None
        parts = urlsplit(instance_url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        replay = d.replay_endpoint_template.format(host=host, port=port) if d.replay_endpoint_template else None
        return KvEventsEndpoint(Endpoint=d.endpoint_template.format(host=host, port=port), ReplayEndpoint=replay)

    def stream_settings(self, replay: bool) -> StreamSettings:
        """The :class:`~.stream.StreamSettings` of an instance with or without replay."""
        return StreamSettings(replay=replay, max_pending=self.max_pending_messages,
                              min_replay_interval_s=self.min_replay_interval_s)
