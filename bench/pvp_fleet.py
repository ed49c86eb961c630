"""The emulated engines of a ``bench/policy_vs_peers.py`` run: their ``prefixroute emulate``
flags (:func:`engine_args`: KV capacity, precise mode's tokenizer and KV events, tiers,
per-token costs scaled for the tiny tokenizer), starting them (:func:`start_fleet`) and
the tiny tokenizer's tokens per default engine token (:func:`tiny_token_ratio`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import sys
from pathlib import Path
from typing import Any

from peer_process import ProcessTracker
from pvp_settings import BenchSettings


#: Tokens of an image part for the tiny tokenizer's engines (``--tokenizer-media-tokens``).
PRECISE_MEDIA_TOKENS = 576


def engine_args(s: BenchSettings, shared_tier: Path | None, token_ratio: float = 1.0) -> list[str]:
    """The ``prefixroute emulate`` flags every engine of a run gets: its KV capacity, and
    for precise mode the tiny tokenizer and KV events (on free ports); the tiers.

    ``token_ratio`` (:func:`tiny_token_ratio`; about 0.55 in precise runs, 3 on the images
    workload, whose stand-in image text the tiny tokenizer cuts finer) is the workload's
    tiny tokens per default engine token. Every per-token size and cost of the engine is scaled
    by it (KV capacity, tiers and the step's token budget times it; prefill and tier loads
    per token divided by it), so that a tiny token stands for ``1 / token_ratio`` of the
    model's tokens: a request costs the engine the same modelled time and cache space as
    on a default engine, the fleet's capacity in requests per second is the same, and
    precise runs offer the same load as the peers' table (decode, per sequence, is not
    scaled).
    """
    from prefixroute.core.tiers import TierSpec
    from prefixroute.engine.model import EngineConfig

    r = token_ratio
    if not 0 < r < math.inf:
        raise ValueError(f"token_ratio must be a positive number, got {r!r}")
    out = ["--kv-capacity-tokens", str(round(s.kv_capacity_tokens * r))]
    if s.precise != "off":
        out += ["--tokenizer", "tiny", "--tokenizer-media-tokens", str(PRECISE_MEDIA_TOKENS), "--kv-events-config",
                '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", '
                '"replay_endpoint": "tcp://127.0.0.1:*"}']
    if r != 1.0:
        d = EngineConfig()
        out += ["--prefill-s-per-token", repr(d.prefill_s_per_token / r),
                "--max-num-batched-tokens", str(max(d.max_num_seqs, round(d.max_num_batched_tokens * r))),
                "--cpu-load-s-per-token", repr(d.cpu_load_s_per_token / r),
                "--shared-load-s-per-token", repr(d.shared_load_s_per_token / r)]
    tiers = TierSpec.parse(s.tiers)
    if tiers.cpu:
        out += ["--cpu-tier-tokens", str(round(tiers.cpu_tokens(s.kv_capacity_tokens) * r))]
    if tiers.shared and shared_tier is not None:
        out += ["--shared-tier", str(shared_tier),
                "--shared-tier-tokens", str(round(tiers.shared_tokens(s.kv_capacity_tokens, s.instances) * r))]
    return out


_ENGINE_READY = re.compile(r"prefixroute-emulate listening on (http://\S+)")


def start_fleet(tracker: ProcessTracker, count: int, s: BenchSettings, python: str = sys.executable,
                token_ratio: float = 1.0) -> list[tuple[str, str]]:
    """Start ``count`` emulated engines at once (flags: :func:`engine_args`); returns
    ``[(instance id, url)]``.

    Raises:
        PeerError: an engine exited or did not listen within 60 s.
    """
    procs = []
    shared_tier = tracker.path("shared-tier", ".kv") if "shared" in s.tiers else None
    for i in range(count):
        iid = f"instance-{i}"
        procs.append((iid, tracker.start(f"engine-{i}", [
            python, "-m", "prefixroute", "emulate", "--host", "127.0.0.1", "--port", "0", "--instance-id", iid,
            "--time-scale", str(s.time_scale), "--log-level", "warning",
            *engine_args(s, shared_tier, token_ratio)])))
    out = []
    for iid, p in procs:
        found: list[str] = []

        def ready(p=p, found=found) -> bool:
            m = _ENGINE_READY.search(p.tail(5))
            if m:
                found.append(m.group(1))
            return bool(m)

        p.wait_ready(ready, 60.0, "listening")
        out.append((iid, found[-1]))
    return out


#: Sessions, and turns of each, whose requests measure :func:`tiny_token_ratio`.
CALIBRATION_SESSIONS = 64
CALIBRATION_TURNS = 6


def tiny_token_ratio(wl: Any, precise: str) -> float:
    """The workload's tiny tokens per default engine token when the engines tokenize with
    the tiny tokenizer (``precise`` ``on`` or ``both``): the prompt tokens of its requests
    over the default engine's (4 bytes a token, :mod:`prefixroute.engine.tokenizer`),
    measured on the first :data:`CALIBRATION_TURNS` turns of the first
    :data:`CALIBRATION_SESSIONS` sessions, each turn after the first resending the answers
    each engine writes (whole words from the tiny vocabulary, one tiny token each; 4-byte
    tokens on the default engine); about 0.55 for the workloads' text, up to 0.7 on
    sharegpt-multi-turn, whose answers are much of its prompts. :func:`engine_args`
    scales the engines' per-token costs and sizes by it. 1.0 when ``precise`` is
    ``off``. An image part is ``PRECISE_MEDIA_TOKENS`` x 4 characters of stand-in text on
    both sides (about 3 tiny tokens per default token). One ratio for every request: a
    conversation's later turns (more answer text) cost somewhat more than on the default
    engine and its first turn less.
    """
    if precise == "off":
        return 1.0
    from prefixroute.core.model_tokenizer import ModelTokenizer
    from prefixroute.engine.http_common import chat_prompt_text
    from prefixroute.engine.tokenizer import count_tokens, decode, output_token_id

    # (as the engines tokenize: an image part as PRECISE_MEDIA_TOKENS tokens)
    tok = dataclasses.replace(ModelTokenizer.load("tiny"), media_tokens=PRECISE_MEDIA_TOKENS)
    tiny = default = 0
    for i, sess in enumerate(itertools.islice(wl.sessions(), CALIBRATION_SESSIONS)):
        tiny_answers: list[str] = []
        default_answers: list[str] = []
        for k in range(min(sess.num_turns, CALIBRATION_TURNS)):
            tiny += len(tok.chat_token_ids(sess.body(k, tiny_answers)))
            default += count_tokens(chat_prompt_text(sess.body(k, default_answers), PRECISE_MEDIA_TOKENS))
            n = sess.turn(k).output_tokens
            seed = i * CALIBRATION_TURNS + k
            tiny_answers.append(tok.decode([output_token_id(seed, j, tok.output_token_ids) for j in range(n)]))
            default_answers.append(decode([output_token_id(seed, j) for j in range(n)]))
    return tiny / default
