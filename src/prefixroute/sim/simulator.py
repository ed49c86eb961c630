"""The discrete-event simulator: the routing core and the engine model on a virtual clock.

Sans-I/O and single-threaded. It drives the very classes that serve traffic, not copies:

* each **router replica** is a :class:`prefixroute.core.pool.VariantPool` with its own
  in-flight counts (replicas do not see each other's requests, as separate router
  processes do not); a request takes a :class:`~prefixroute.core.pool.Lease` on arrival
  and releases it when its last token is delivered;
* each **instance** is an :class:`prefixroute.engine.core.EngineCore` stepping back to
  back while it has work, exactly as :mod:`prefixroute.engine.server` drives it in real
  time: a step's outputs become visible at the step's end, a request that arrives during
  a step waits for the next one. Runs of identical pure-decode steps are applied at once
  (:meth:`~prefixroute.engine.core.EngineCore.advance_decode`), cut short at the step
  boundary after an arrival, which gives the same schedule as stepping one by one.

Clock: model seconds from the start of the run; events are kept in a heap ordered by
time, ties broken by insertion order (so a run is deterministic for a seed).

Time a request spends outside the engine (client -> router -> engine and back) is one
constant, :attr:`SimConfig.overhead_s`, added between the client's send and the
engine's arrival; 0 by default (docs/SIMULATOR.md explains the choice).
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.kvevents.view import PreciseCacheView
from prefixroute.core.pool import Lease, NoHealthyInstance, VariantPool
from prefixroute.core.precise_policy import PreciseRequest
from prefixroute.engine.core import EngineCore, HashedPrompt, RequestRejected, StepOutput
from prefixroute.engine.kvcache import prompt_block_hashes
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.tiers import MemorySharedTier
from prefixroute.engine.tokenizer import decode, tokenize
from prefixroute.core.keys import LLMD_BLOCK_CHARS, LLMD_MAX_BLOCKS
from prefixroute.sim.blocks import prompt_blocks, prompt_fixed_blocks
from prefixroute.sim.precise import DirectObserver
from prefixroute.workloads.session import Session, Workload

__all__ = ["MembershipChange", "SimConfig", "RequestRecord", "SimResult", "Simulator", "simulate", "instance_ids",
           "parse_changes"]


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """An instance joins or leaves the fleet at a model time.

    Attributes:
        at_s: model seconds from the start.
        action: ``"add"`` (a new instance with a cold cache) or ``"remove"`` (it gets no
            new requests and finishes the ones it has).
        instance: the instance id.
    """

    at_s: float
    action: str
    instance: str

    def __post_init__(self) -> None:
        if self.action not in ("add", "remove"):
            raise ValueError(f"membership change action must be 'add' or 'remove', got {self.action!r}")
        if self.at_s < 0:
            raise ValueError(f"membership change time must be >= 0 s, got {self.at_s}")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run.

    Attributes:
        instances: ids of the instances present at the start (rendezvous scores use them).
        routing: the production variant's validated routing configuration.
        engine: every instance's engine configuration.
        replicas: router replicas; each counts only its own requests in flight.
        replica_per: ``"request"``: each request goes to a replica drawn uniformly at
            random (clients behind a plain load balancer); ``"session"``: every turn of a
            session goes to the replica drawn when it starts (clients that keep their
            connection, as ``bench/policy_vs_peers.py``'s users do).
        duration_s: model seconds during which new turns may start (open loop: arrivals
            after it are dropped; closed loop: users stop). Requests in flight finish.
        users: closed loop with this many users, each running sessions back to back
            (a session's turns one after another, with its think times); ``None`` = open
            loop, sessions start at their ``start_s``.
        overhead_s: model seconds from a client's send to the engine's arrival (router
            and network), counted in TTFT and latency.
        changes: instances added or removed during the run.
        seed: seeds the choice of replica and the pools' random choices.
        fast_forward: apply runs of pure-decode steps at once (same result, faster).
        exact_text: build the prompts' text and route on the HTTP router's keys (slow;
            for checking the fast path).
        max_requests: stop starting turns after this many requests (None = no limit).
        engine_load_interval_s: every this many model seconds, each replica reads every
            engine's requests running plus waiting into
            :attr:`~prefixroute.core.strategies.InstanceState.engine_load`, as
            ``prefixroute serve`` scrapes the engines' ``/metrics``
            (``--metrics-scrape-interval``); replica ``r`` reads at offset
            ``r / replicas`` of the interval. None: never (``engine_load`` stays 0).
        shared_tier_tokens: capacity of a KV tier shared by every instance, tokens
            (:class:`~prefixroute.engine.tiers.MemorySharedTier`); 0 (default): none.
            The CPU tier of each instance is ``engine.cpu_tier_tokens``.
        precise: precise mode: every engine's cache changes, per medium, in
            :attr:`Simulator.kv_view` (a :class:`~prefixroute.core.kvevents.view.PreciseCacheView`
            keyed by the prompts' block hashes, :mod:`prefixroute.sim.precise`), and
            ``CACHE_AWARE`` requests carry their keys (``blocks.precise``), so the
            strategy decides on what the engines hold (:mod:`prefixroute.core.precise_policy`),
            as the router does with KV events.

    Raises:
        ValueError: on construction, for no instances, duplicate ids, replicas < 1,
            users < 1, or a negative duration or overhead.
    """

    instances: tuple[str, ...]
    routing: RoutingConfig
    engine: EngineConfig = field(default_factory=EngineConfig)
    replicas: int = 1
    duration_s: float = 60.0
    users: int | None = None
    overhead_s: float = 0.0
    changes: tuple[MembershipChange, ...] = ()
    seed: int = 0
    fast_forward: bool = True
    exact_text: bool = False
    max_requests: int | None = None
    engine_load_interval_s: float | None = None
    replica_per: str = "request"
    shared_tier_tokens: int = 0
    precise: bool = False

    def __post_init__(self) -> None:
        if not self.instances:
            raise ValueError("a simulation needs at least one instance")
        if len(set(self.instances)) != len(self.instances):
            raise ValueError(f"duplicate instance ids in {list(self.instances)}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.users is not None and self.users < 1:
            raise ValueError(f"users must be >= 1 (or None for open loop), got {self.users}")
        if self.duration_s < 0 or self.overhead_s < 0:
            raise ValueError("duration_s and overhead_s must be >= 0 seconds")
        if self.replica_per not in ("request", "session"):
            raise ValueError(f"replica_per must be 'request' or 'session', got {self.replica_per!r}")
        if self.engine_load_interval_s is not None and not self.engine_load_interval_s > 0:
            raise ValueError(f"engine_load_interval_s must be > 0 seconds or None, got {self.engine_load_interval_s}")
        if self.shared_tier_tokens < 0 or 0 < self.shared_tier_tokens < self.engine.block_size:
            raise ValueError(f"shared_tier_tokens must be 0 (no shared tier) or hold at least one block of "
                             f"{self.engine.block_size} tokens, got {self.shared_tier_tokens}")


@dataclass(slots=True)
class RequestRecord:
    """What happened to one simulated request. Times are model seconds.

    Attributes:
        index: request number (order of arrival).
        session: index of its session (order of start); turn: its turn in the session.
        group: the session's group (document, system prompt...).
        arrival_s: when the client sent it.
        replica: the router replica that routed it.
        instance: the instance id ("" if it could not be routed).
        decision: the router's decision kind (``affinity``, ``overflow``...).
        prompt_tokens, cached_tokens: tokens of the prompt and of it found cached.
        ttft_s, latency_s: time to first token and to the last token (None if it failed).
        error: why it failed ("" if it did not).
    """

    index: int
    session: int
    turn: int
    group: int
    arrival_s: float
    replica: int
    instance: str = ""
    decision: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str = ""


@dataclass
class SimResult:
    """The outcome of one run.

    Attributes:
        config: what was simulated.
        workload: the workload's description.
        requests: one record per request, in order of arrival.
        instances: every instance that took part, in order of joining.
        cache_hits, cache_queries: prefix-cache hit and query tokens summed over the
            engines (``vllm:prefix_cache_hits_total`` / ``..._queries_total``).
        end_s: model time of the last event.
        wall_s: real seconds the simulation took.
        events: events processed.
    """

    config: SimConfig
    workload: str
    requests: list[RequestRecord]
    instances: list[str]
    cache_hits: int
    cache_queries: int
    end_s: float
    wall_s: float
    events: int

    @property
    def cache_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens over the run (0.0 with no queries)."""
        return self.cache_hits / self.cache_queries if self.cache_queries else 0.0

    def results(self) -> list:
        """The requests as :class:`prefixroute.demo.loadgen.RequestResult` (model seconds),
        the form the demo's report functions take."""
        from prefixroute.demo.loadgen import RequestResult

        return [
            RequestResult(r.index, r.group, r.arrival_s, r.ttft_s, r.latency_s, 200 if not r.error else 0,
                          r.instance, r.decision, None, r.prompt_tokens, r.cached_tokens, r.error)
            for r in self.requests
        ]

    def summary(self, strategy_label: str | None = None):
        """The run as a :class:`prefixroute.demo.report.RunSummary` (SPEC §7 fields,
        model seconds; ``router`` is ``prefixroute-sim``; extra fields: overflow rate,
        decisions)."""
        from prefixroute.demo.report import summarize

        results = self.results()
        done = [r.arrival_s + r.latency_s for r in self.requests if r.latency_s is not None]
        first = min((r.arrival_s for r in self.requests), default=0.0)
        wall = (max(done) - first) if done else 0.0
        label = strategy_label or self.config.routing.strategy.value
        s = summarize(label, results, wall, 1.0, self.instances, self.cache_hits, self.cache_queries,
                      router="prefixroute-sim", replicas=self.config.replicas)
        return s


# -- the event loop -----------------------------------------------------------------------

_NEW_SESSION, _ARRIVE, _ENGINE_IN, _STEP_END, _CHANGE, _SCRAPE = range(6)
_IDLE, _STEP, _RUN = range(3)


class _Instance:
    __slots__ = ("id", "core", "state", "version", "pending", "run_start", "run_d", "run_k")

    def __init__(self, instance_id: str, engine: EngineConfig, shared_tier: MemorySharedTier | None,
                 observer: DirectObserver | None = None) -> None:
        self.id = instance_id
        self.core = EngineCore(engine, shared_tier=shared_tier, events=observer)  # type: ignore[arg-type]
        self.state = _IDLE
        self.version = 0
        self.pending: StepOutput | None = None
        self.run_start = 0.0
        self.run_d = 0.0
        self.run_k = 0


class _Flight:
    __slots__ = ("record", "lease", "session", "turn", "answers", "tokens", "output_tokens", "prompt", "instance",
                 "engine_prompt")

    def __init__(self, record, lease, session, turn, answers, output_tokens, prompt, instance,
                 engine_prompt=None) -> None:
        self.engine_prompt = engine_prompt
        self.record = record
        self.lease = lease
        self.session = session
        self.turn = turn
        self.answers = answers
        self.tokens: list[int] | None = [] if answers is not None else None
        self.output_tokens = output_tokens
        self.prompt = prompt
        self.instance = instance


class Simulator:
    """One run of a workload through a simulated fleet (see module docstring).

    Args:
        config: what to simulate.
        workload: a seeded workload (``sessions()`` and ``describe()``).
        progress: called now and then with the current model time (seconds), for progress bars.
    """

    def __init__(self, config: SimConfig, workload: Workload,
                 progress: Callable[[float], None] | None = None) -> None:
        self.config = config
        self.workload = workload
        self.progress = progress
        self._rng = random.Random(f"sim-{config.seed}")
        self._heap: list[tuple] = []
        self._seq = itertools.count()
        self._shared_tier = (MemorySharedTier(config.shared_tier_tokens // config.engine.block_size)
                             if config.shared_tier_tokens else None)
        #: Precise state (``config.precise``), else ``None``.
        self.kv_view = PreciseCacheView(config.engine.block_size) if config.precise else None
        self._instances: dict[str, _Instance] = {}
        self._order: list[str] = []
        self._members: list[str] = []
        self._pools = [VariantPool(f"replica-{i}", config.instances, config.routing, seed=config.seed * 1000 + i)
                       for i in range(config.replicas)]
        for iid in config.instances:
            self._add_instance(iid)
        pa, ca = config.routing.prefix_aware, config.routing.cache_aware
        self._prefix_length = (pa.prefix_length if config.routing.strategy is RoutingStrategy.PREFIX_AWARE
                               and pa is not None else None)
        # CACHE_AWARE routes on chained blocks of the routing text (sim.blocks: from the
        # prompts' routing keys, the router's own hashes for exact text).
        self._blocks = ((ca.block_size, ca.max_prefix_length, ca.media_tokens * 4) if config.routing.strategy is
                        RoutingStrategy.CACHE_AWARE and ca is not None else None)
        self._fixed_blocks = config.routing.strategy is RoutingStrategy.LLMD_REFERENCE
        self._flights: dict[str, _Flight] = {}
        self._records: list[RequestRecord] = []
        self._sessions: Iterator[Session] = iter(workload.sessions())
        self._session_index: dict[int, int] = {}
        self._session_replica: dict[int, int] = {}
        self._started_sessions = 0
        self._parked = 0  # closed-loop users whose request found no instance, until one is added
        self._stopped = False
        self.now = 0.0

    # -- set-up ------------------------------------------------------------------------

    def _add_instance(self, iid: str) -> None:
        if iid not in self._instances:
            observer = None
            if self.kv_view is not None:
                stream = self.kv_view.add_instance(iid)
                stream.on_connected(complete=True)
                observer = DirectObserver(stream.index)
            self._instances[iid] = _Instance(iid, self.config.engine, self._shared_tier, observer)
            self._order.append(iid)
        if iid not in self._members:
            self._members.append(iid)

    def _push(self, t: float, kind: int, a: object = None, b: object = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, a, b))

    # -- run ---------------------------------------------------------------------------

    def run(self) -> SimResult:
        """Run to completion: every turn that starts before ``duration_s`` finishes."""
        wall0 = time.perf_counter()
        cfg = self.config
        for ch in sorted(cfg.changes, key=lambda c: c.at_s):
            self._push(ch.at_s, _CHANGE, ch)
        if cfg.engine_load_interval_s is not None:
            for r in range(cfg.replicas):
                self._push(cfg.engine_load_interval_s * r / cfg.replicas, _SCRAPE, r)
        if cfg.users is None:
            self._next_open_session()
        else:
            for _ in range(cfg.users):
                self._start_closed_session(0.0)
        heap = self._heap
        pop = heapq.heappop
        events = 0
        next_report = 0
        progress = self.progress
        while heap:
            t, _, kind, a, b = pop(heap)
            self.now = t
            events += 1
            if kind == _STEP_END:
                self._step_end(a, b, t)
            elif kind == _ARRIVE:
                self._arrive(a, b, t)
            elif kind == _ENGINE_IN:
                self._engine_in(a, t)
            elif kind == _NEW_SESSION:
                self._begin_session(a, t)
                self._next_open_session()
            elif kind == _SCRAPE:
                if self._scrape(a, t):
                    self._push(t + cfg.engine_load_interval_s, _SCRAPE, a)
            else:
                self._change(a, t)
            if progress is not None and events >= next_report:
                next_report = events + 5000
                progress(t)
        if progress is not None:
            progress(self.now)
        hits = queries = 0
        for inst in self._instances.values():
            st = inst.core.stats()
            hits += st.prefix_cache_hits
            queries += st.prefix_cache_queries
        return SimResult(cfg, self.workload.describe(), self._records, list(self._order), hits, queries,
                         self.now, time.perf_counter() - wall0, events)

    # -- sessions ----------------------------------------------------------------------

    def _may_start(self, t: float) -> bool:
        cfg = self.config
        if t > cfg.duration_s:
            return False
        return cfg.max_requests is None or len(self._records) < cfg.max_requests

    def _next_open_session(self) -> None:
        if self._stopped:
            return
        s = next(self._sessions, None)
        if s is None or not self._may_start(s.start_s):
            self._stopped = True
            return
        self._push(s.start_s, _NEW_SESSION, s)

    def _start_closed_session(self, t: float) -> None:
        if self._stopped or not self._may_start(t):
            return
        s = next(self._sessions, None)
        if s is None:
            self._stopped = True
            return
        self._begin_session(s, t)

    def _begin_session(self, s: Session, t: float) -> None:
        cfg = self.config
        if cfg.replica_per == "session" and cfg.replicas > 1:
            self._session_replica[id(s)] = self._rng.randrange(cfg.replicas)
        self._session_index[id(s)] = self._started_sessions
        self._started_sessions += 1
        self._arrive(s, (0, [] if self.config.exact_text else None), t)

    def _session_done(self, s: Session, t: float) -> None:
        self._session_index.pop(id(s), None)
        self._session_replica.pop(id(s), None)
        if self.config.users is not None:
            self._start_closed_session(t)

    # -- requests ----------------------------------------------------------------------

    def _arrive(self, s: Session, state: tuple[int, list[str] | None], t: float) -> None:
        k, answers = state
        if k > 0 and not self._may_start(t):
            self._session_done(s, t)
            return
        cfg = self.config
        turn = s.turn(k, answers)
        replica = self._session_replica.get(id(s)) if cfg.replica_per == "session" else None
        if replica is None:
            replica = self._rng.randrange(cfg.replicas) if cfg.replicas > 1 else 0
        rec = RequestRecord(len(self._records), self._session_index.get(id(s), -1), k, s.group, t, replica,
                            prompt_tokens=turn.prompt.num_tokens)
        self._records.append(rec)
        key = turn.prompt.routing_key(self._prefix_length) if self._prefix_length is not None else None
        engine_prompt = None
        if self._blocks is not None:
            blocks: Sequence[int] = prompt_blocks(turn.prompt, *self._blocks)
            if self.kv_view is not None:  # precise mode: the request's KV block keys, as the router computes them
                engine_prompt = turn.prompt.engine_prompt(cfg.engine.block_size)
                blocks.precise = self._precise_request(engine_prompt)  # type: ignore[attr-defined]
        elif self._fixed_blocks:
            blocks = prompt_fixed_blocks(turn.prompt, LLMD_BLOCK_CHARS, LLMD_MAX_BLOCKS)
        else:
            blocks = ()
        try:
            lease: Lease = self._pools[replica].acquire(key, (), blocks)
        except NoHealthyInstance as exc:
            rec.error = str(exc)
            if self.config.users is not None:
                # A closed-loop user would fail again at once, forever, at this model
                # time: it waits for an instance to join instead.
                self._session_index.pop(id(s), None)
                self._parked += 1
                return
            self._session_done(s, t)
            return
        decision = lease.decision
        rec.instance = decision.instance.instance_id
        rec.decision = decision.kind.value
        flight = _Flight(rec, lease, s, k, answers, turn.output_tokens, turn.prompt, self._instances[rec.instance],
                         engine_prompt)
        rid = str(rec.index)
        self._flights[rid] = flight
        if cfg.overhead_s > 0:
            self._push(t + cfg.overhead_s, _ENGINE_IN, rid)
        else:
            self._engine_in(rid, t)

    def _precise_request(self, engine_prompt: object) -> PreciseRequest:
        """A request's precise-mode data: its full prompt blocks' hashes, which are the
        keys :class:`DirectObserver` indexes the engines' caches by."""
        bs = self.config.engine.block_size
        if isinstance(engine_prompt, HashedPrompt):
            n = engine_prompt.num_tokens
            keys = list(engine_prompt.block_hashes[: n // bs])
        else:  # the exact path's text, as the engine tokenizes it
            tokenized = tokenize(engine_prompt)  # type: ignore[arg-type]
            n = tokenized.num_tokens
            keys = prompt_block_hashes(tokenized, bs)
        assert self.kv_view is not None
        return PreciseRequest(self.kv_view, keys, n, bs)

    def _engine_in(self, rid: str, t: float) -> None:
        flight = self._flights[rid]
        inst = flight.instance
        if inst.state == _RUN:
            # The run's steps that started before t go on without the new request; it is
            # admitted by the step that starts at the first boundary after t.
            j = min(inst.run_k, int((t - inst.run_start) / inst.run_d) + 1)
            inst.pending = inst.core.advance_decode(j)  # before the request joins the queue
            inst.state = _STEP
            if j < inst.run_k:  # else the run's own end event stands
                inst.version += 1
                self._push(inst.run_start + j * inst.run_d, _STEP_END, inst, inst.version)
        try:
            prompt = flight.engine_prompt
            if prompt is None:
                prompt = flight.prompt.engine_prompt(self.config.engine.block_size)
            inst.core.add_request(rid, prompt, flight.output_tokens)
        except RequestRejected as exc:
            self._fail(rid, str(exc), t)
            return
        flight.prompt = flight.engine_prompt = None  # the engine has it; free the chain
        if inst.state == _IDLE:
            self._start_next(inst, t)

    def _fail(self, rid: str, error: str, t: float) -> None:
        flight = self._flights.pop(rid)
        flight.record.error = error
        flight.lease.release()
        self._session_done(flight.session, t)

    # -- instances ---------------------------------------------------------------------

    def _start_next(self, inst: _Instance, t: float) -> None:
        core = inst.core
        if not core.has_work():
            inst.state = _IDLE
            inst.pending = None
            return
        if self.config.fast_forward:
            k, d = core.decode_run()
            if k >= 2:
                inst.state = _RUN
                inst.run_start, inst.run_d, inst.run_k = t, d, k
                inst.pending = None
                inst.version += 1
                self._push(t + k * d, _STEP_END, inst, inst.version)
                return
        out = core.step()
        if out.duration_s == 0.0 and not out.outputs:
            inst.state = _IDLE  # nothing schedulable (cannot happen: oversized requests are refused)
            return
        inst.state = _STEP
        inst.pending = out
        inst.version += 1
        self._push(t + out.duration_s, _STEP_END, inst, inst.version)

    def _step_end(self, inst: _Instance, version: int, t: float) -> None:
        if version != inst.version:
            return  # a run that was cut short; its replacement event is in the heap
        if inst.state == _RUN:
            out = inst.core.advance_decode(inst.run_k)
        else:
            out = inst.pending
        inst.pending = None
        inst.state = _STEP  # busy until the next step is planned: arrivals now just queue
        if out is not None:
            self._deliver(out, t)
        self._start_next(inst, t)

    def _deliver(self, out: StepOutput, t: float) -> None:
        flights = self._flights
        for o in out.outputs:
            flight = flights.get(o.request_id)
            if flight is None:
                continue
            if flight.tokens is not None:
                flight.tokens.extend(o.new_token_ids)
            rec = flight.record
            if o.first_token:
                rec.ttft_s = t - rec.arrival_s
                flight.lease.first_token()
            if o.finished:
                del flights[o.request_id]
                rec.latency_s = t - rec.arrival_s
                rec.cached_tokens = o.cached_tokens
                flight.lease.release()
                s = flight.session
                k = flight.turn + 1
                if k < s.num_turns:
                    answers = flight.answers
                    if answers is not None and flight.tokens is not None:
                        answers = answers + [decode(flight.tokens)]
                    self._push(t + s.think_s(k), _ARRIVE, s, (k, answers))
                else:
                    self._session_done(s, t)

    def _scrape(self, replica: int, t: float) -> bool:
        """Replica ``replica`` reads every engine's running + waiting; ``False`` once
        nothing is left to happen (no request in flight and no session may start)."""
        pool = self._pools[replica]
        for iid, inst in self._instances.items():
            state = pool.get(iid)
            if state is not None:
                st = inst.core.stats()
                state.engine_load = st.num_running + st.num_waiting
                state.engine_waiting = st.num_waiting
                state.engine_kv_usage = st.kv_cache_usage
        return bool(self._flights) or (not self._stopped and t <= self.config.duration_s)

    def _change(self, ch: MembershipChange, t: float) -> None:
        if ch.action == "add":
            self._add_instance(ch.instance)
        elif ch.instance in self._members:
            self._members.remove(ch.instance)
        for pool in self._pools:
            pool.set_instances(self._members)
        if ch.action == "add" and self._parked:  # closed-loop users left without an instance
            parked, self._parked = self._parked, 0
            for _ in range(parked):
                self._start_closed_session(t)


def simulate(config: SimConfig, workload: Workload, progress: Callable[[float], None] | None = None) -> SimResult:
    """Run one simulation (``Simulator(config, workload, progress).run()``)."""
    return Simulator(config, workload, progress).run()


def instance_ids(n: int, prefix: str = "instance-") -> tuple[str, ...]:
    """``("instance-0", ..., "instance-{n-1}")``."""
    return tuple(f"{prefix}{i}" for i in range(n))


def parse_changes(specs: Iterable[str]) -> tuple[MembershipChange, ...]:
    """Parse ``"add:120:instance-7"`` / ``"remove:300:instance-2"`` specs (CLI form).

    Raises:
        ValueError: a spec that is not ``ACTION:SECONDS:INSTANCE``.
    """
    out = []
    for spec in specs:
        parts = spec.split(":", 2)
        if len(parts) != 3:
            raise ValueError(f"membership change {spec!r} is not ACTION:SECONDS:INSTANCE (e.g. add:120:instance-7)")
        action, at, iid = parts
        try:
            at_s = float(at)
        except ValueError:
            raise ValueError(f"membership change {spec!r}: {at!r} is not a number of seconds") from None
        out.append(MembershipChange(at_s, action, iid))
    return tuple(out)

