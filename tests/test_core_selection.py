"""Pool selection before the strategy: inference components, models, LoRA sticky sets.

Everything here is the sans-I/O core: configuration, the catalog of what instances
serve, the selector, component pools, candidate subsets and adapter load planning.
"""

from __future__ import annotations

import pytest

from prefixroute.core.adapters import AdapterTracker, plan_load
from prefixroute.core.catalog import ModelCatalog, ServedModels, parse_model_list
from prefixroute.core.config import DISCOVER, ConfigError, FleetConfig, RoutingConfig
from prefixroute.core.counters import config_slot_keys, slot_key
from prefixroute.core.endpoint import Fleet, UnknownComponent
from prefixroute.core.keys import openai_route
from prefixroute.core.openai_routes import OpenAIRoute, keyed_view, route_for_path, scoped_model
from prefixroute.core.pool import NoHealthyInstance, SetSaturated, VariantPool
from prefixroute.core.selection import ComponentRequired, Selector, UnknownModel
from prefixroute.core.strategies import DecisionKind

A, B, C, D = (f"http://10.0.0.{i}:8000" for i in range(1, 5))
PA = {"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {"PrefixLength": 1024, "ConcurrencyThreshold": 2}}


def fleet_config(**endpoint) -> FleetConfig:
    ep = {"EndpointName": "e", "ProductionVariants": [
        {"VariantName": "AllTraffic", "Instances": [A, B, C, D], "RoutingConfig": PA}], **endpoint}
    return FleetConfig.from_mapping({"Endpoints": [ep]})


def vllm_models(base: str, *adapters: str) -> dict:
    """A /v1/models answer in vLLM's shape (base card, then one card per adapter)."""
    cards = [{"id": base, "object": "model", "owned_by": "vllm", "root": f"/models/{base}", "parent": None}]
    cards += [{"id": a, "object": "model", "owned_by": "vllm", "root": f"/adapters/{a}", "parent": base}
              for a in adapters]
    return {"object": "list", "data": cards}


# -- configuration ---------------------------------------------------------------------


def test_components_and_lora_parse_with_defaults():
    cfg = fleet_config(InferenceComponents=[
        {"InferenceComponentName": "llama", "ModelName": "meta/llama", "Instances": [A, B], "RoutingConfig": PA},
        {"InferenceComponentName": "qwen", "Instances": "discover"}],
        LoraAdapters={"Autoload": True, "Adapters": [{"LoraName": "sql", "LoraPath": "/a/sql"}]})
    ep = cfg.endpoints[0]
    llama, qwen = ep.components
    assert (llama.model_name, llama.instances, llama.discover) == ("meta/llama", (A, B), False)
    assert (qwen.model_name, qwen.instances, qwen.discover) == ("qwen", DISCOVER, True)
    assert ep.component_routing(qwen) is ep.variants[0].routing  # inherits the variant's
    assert ep.component_routing(llama).prefix_aware.concurrency_threshold == 2
    assert ep.lora.autoload is True and ep.lora.path_of("sql").path == "/a/sql"
    assert ep.lora.path_of("other") is None


@pytest.mark.parametrize("components, needle", [
    ([{"InferenceComponentName": "ic", "Instances": ["http://elsewhere:1"]}],
     "'http://elsewhere:1' is not an instance of production variant 'AllTraffic'"),
    ([{"InferenceComponentName": "ic_1"}], "must be letters, digits and inner hyphens"),
    ([{"InferenceComponentName": "ic", "Instances": "sometimes"}], "neither a list of instance URLs nor DISCOVER"),
    ([{"InferenceComponentName": "ic", "Instances": []}], "neither a non-empty list"),
    ([{"InferenceComponentName": "a"}, {"InferenceComponentName": "a"}], "duplicate InferenceComponentName 'a'"),
    ([{"InferenceComponentName": "a", "ModelName": "m"}, {"InferenceComponentName": "b", "ModelName": "m"}],
     "ModelName 'm' is served by more than one inference component"),
    ([{"InferenceComponentName": "ic", "VariantName": "Blue"}], "VariantName 'Blue' is not a production variant"),
    ([{"InferenceComponentName": "x" * 64}], "InferenceComponentName"),
])
def test_component_config_errors_name_the_problem(components, needle):
    with pytest.raises(ConfigError) as exc:
        fleet_config(InferenceComponents=components)
    assert needle in str(exc.value)


def test_lora_config_errors():
    with pytest.raises(ConfigError, match="duplicate LoraName 'x'"):
        fleet_config(LoraAdapters={"Adapters": [{"LoraName": "x", "LoraPath": "/1"}, {"LoraName": "x", "LoraPath": "/2"}]})
    with pytest.raises(ConfigError, match="Autoload: 'yes' is not true or false"):
        fleet_config(LoraAdapters={"Autoload": "yes"})
    with pytest.raises(ConfigError, match="RetryAfterSeconds"):
        fleet_config(LoraAdapters={"RetryAfterSeconds": 0})
    for bad, needle in ((0, "greater than or equal to 0.1"), (90_000, "less than or equal to 86400"),
                        (True, "True is not a number of seconds"), ("soon", "valid number"),
                        (float("inf"), "finite number")):
        with pytest.raises(ConfigError, match=f"LoraAdapters.IdleSeconds: .*{needle}"):
            fleet_config(LoraAdapters={"IdleSeconds": bad})


def test_lora_idle_seconds_default_to_the_load_timeout():
    lora = fleet_config(LoraAdapters={"Autoload": True}).endpoints[0].lora
    assert lora.idle_s is None and lora.idle_after_s == lora.load_timeout_s == 60.0
    assert fleet_config(LoraAdapters={"LoadTimeoutSeconds": 20}).endpoints[0].lora.idle_after_s == 20.0
    assert fleet_config(LoraAdapters={"IdleSeconds": 0.5}).endpoints[0].lora.idle_after_s == 0.5


def test_slot_keys_cover_component_copies():
    cfg = fleet_config(InferenceComponents=[{"InferenceComponentName": "ic", "Instances": [A]},
                                            {"InferenceComponentName": "d", "Instances": "DISCOVER"}])
    keys = set(config_slot_keys(cfg))
    assert slot_key("e", "AllTraffic\0ic", A) in keys and slot_key("e", "AllTraffic\0ic", B) not in keys
    assert {slot_key("e", "AllTraffic\0d", i) for i in (A, B, C, D)} <= keys  # every possible copy


# -- the catalog -----------------------------------------------------------------------


def test_parse_vllm_model_list():
    served = parse_model_list(vllm_models("llama", "sql", "chat"))
    assert served.base == ("llama",) and served.adapters == {"sql": "llama", "chat": "llama"}
    assert served.roots["sql"] == "/adapters/sql" and served.serves("chat") and not served.serves("x")
    odd = parse_model_list({"data": [{"id": "a"}, "junk", {"id": 3}, {"object": "model"}]})
    assert odd.base == ("a",) and odd.adapters == {}
    with pytest.raises(ValueError, match="'data' list"):
        parse_model_list({"models": []})


def test_a_model_list_that_differs_only_in_its_timestamps_is_no_change():
    cat = ModelCatalog()
    first = {"object": "list", "data": [{"id": "llama", "object": "model", "created": 1, "root": "llama"}]}
    assert cat.set(A, parse_model_list(first)) is True
    again = {"object": "list", "data": [{"id": "llama", "object": "model", "created": 2, "root": "llama"}]}
    assert cat.set(A, parse_model_list(again)) is False  # (vLLM stamps each answer: no log line per round)
    other = {"object": "list", "data": [{"id": "llama", "object": "model", "created": 3, "root": "/llama-v2"}]}
    assert cat.set(A, parse_model_list(other)) is True and cat.adapter_root("llama") is None


def test_catalog_index_generation_and_lora_info():
    cat = ModelCatalog()
    cat.set(A, parse_model_list(vllm_models("llama", "sql")))
    cat.set(B, parse_model_list(vllm_models("llama")))
    cat.set(C, parse_model_list(vllm_models("qwen")))
    assert cat.serving("llama") == {A, B} and cat.serving("sql") == {A} and cat.serving("nope") == frozenset()
    assert cat.adapter_parent("sql") == "llama" and cat.adapter_root("sql") == "/adapters/sql"
    # The router loads "sql" on B; a list fetched before that must not undo it.
    gen = cat.generation(B)
    cat.adapter_loaded(B, "sql", "llama", "/adapters/sql")
    assert cat.serving("sql") == {A, B}
    assert cat.set(B, parse_model_list(vllm_models("llama")), generation=gen) is False
    assert cat.serving("sql") == {A, B}
    # The router unloads it from A: it leaves the set before the unload is sent.
    cat.adapter_unloading(A, "sql")
    assert cat.serving("sql") == {B}
    # vLLM's lora_requests_info: slots and adapters running (loaded).
    assert cat.set_lora_info(C, ["qlora"], 2) is True
    assert cat.slots(C) == 2 and cat.serving("qlora") == {C} and cat.adapter_parent("qlora") == "qwen"
    assert cat.slots(D, 3) == 3 and cat.set_lora_info(D, ["x"], 1) is False  # unlisted: ignored
    # A later /v1/models without max_lora keeps the slots the metric reported.
    cat.set(C, parse_model_list(vllm_models("qwen", "qlora")))
    assert cat.slots(C) == 2
    version = cat.version
    cat.forget([A, B])
    assert cat.serving("qwen") == frozenset() and cat.version > version


# -- components and pools ---------------------------------------------------------------


def make_fleet(**endpoint) -> tuple[Fleet, ModelCatalog]:
    return Fleet(fleet_config(**endpoint), seed=7), ModelCatalog()


def test_component_pool_has_its_own_copies_state_and_routing():
    fleet, _ = make_fleet(InferenceComponents=[
        {"InferenceComponentName": "ic", "Instances": [A, B],
         "RoutingConfig": {"RoutingStrategy": "PREFIX_AWARE",
                           "PrefixAwareRoutingConfig": {"PrefixLength": 2048, "ConcurrencyThreshold": 1}}}])
    ep = fleet.endpoint("e")
    comp, variant = ep.component("ic"), ep.variant()
    assert comp.component == "ic" and comp.name == "AllTraffic" and comp.describe == "inference component 'ic'"
    assert [i.instance_id for i in comp.instances] == [A, B]
    assert comp.get(A) is not variant.get(A)  # in-flight per component copy
    leases = [comp.acquire(k) for k in range(2)]
    assert {lease.instance.instance_id for lease in leases} <= {A, B}
    assert variant.total_in_flight() == 0 and comp.total_in_flight() == 2
    # threshold 1 per copy: two requests with the same key land on both copies
    for lease in leases:
        lease.release()
    first, second = comp.acquire(99), comp.acquire(99)
    assert {first.instance.instance_id, second.instance.instance_id} == {A, B}
    assert second.decision.kind is DecisionKind.OVERFLOW
    assert ("e", comp) in fleet.all_pools()
    with pytest.raises(UnknownComponent, match="'nope' is not valid for endpoint 'e'.*inference components: ic"):
        ep.component("nope")


def test_component_routing_switches_without_touching_in_flight():
    fleet, _ = make_fleet(InferenceComponents=[{"InferenceComponentName": "ic", "Instances": [A, B]}])
    comp = fleet.endpoint("e").component("ic")
    lease = comp.acquire(1)
    new = fleet.config.model_copy(update={"endpoints": (fleet.config.endpoints[0].model_copy(update={
        "components": (fleet.config.endpoints[0].components[0].model_copy(
            update={"routing": RoutingConfig.build("least-outstanding-requests")}),)}),)})
    fleet.apply(new)
    assert fleet.endpoint("e").component("ic") is comp
    assert comp.routing.strategy.value == "LEAST_OUTSTANDING_REQUESTS" and comp.total_in_flight() == 1
    lease.release()
    assert comp.total_in_flight() == 0


def test_discovered_component_copies_follow_the_catalog():
    fleet, cat = make_fleet(InferenceComponents=[{"InferenceComponentName": "qwen", "ModelName": "qwen-7b"}])
    comp = fleet.endpoint("e").component("qwen")
    assert comp.instances == ()  # nothing known: no copy, never a request to a stranger
    with pytest.raises(NoHealthyInstance, match="inference component 'qwen' has no healthy copy"):
        comp.acquire(1)
    cat.set(C, parse_model_list(vllm_models("qwen-7b")))
    cat.set(D, parse_model_list(vllm_models("qwen-7b")))
    cat.set(A, parse_model_list(vllm_models("llama")))
    assert fleet.discover_components(cat) is True
    assert [i.instance_id for i in comp.instances] == [C, D]
    assert fleet.discover_components(cat) is False
    fleet.apply(fleet.config)  # a reload keeps what was discovered
    assert [i.instance_id for i in fleet.endpoint("e").component("qwen").instances] == [C, D]


def test_candidate_subset_is_honoured_and_saturation_refused():
    pool = VariantPool("v", [A, B, C, D], RoutingConfig.build("prefix-aware", 1024, 2), seed=1)
    only = frozenset({B, D})
    chosen = {pool.choose(k, only=only).instance.instance_id for k in range(200)}
    assert chosen == {B, D}
    leases = [pool.acquire(k, only=only, refuse_all_busy=True) for k in range(4)]
    assert sorted(lease.instance.instance_id for lease in leases) == [B, B, D, D]
    with pytest.raises(SetSaturated, match="at its ConcurrencyThreshold \\(2\\)"):
        pool.acquire(5, only=only, refuse_all_busy=True)
    assert pool.acquire(5, only=only).decision.kind is DecisionKind.ALL_BUSY  # without refusal: all_busy
    pool.set_healthy(B, False)
    pool.set_healthy(D, False)
    with pytest.raises(NoHealthyInstance, match="serving the requested model"):
        pool.choose(1, only=only)


def test_lease_releases_what_is_attached():
    tracker = AdapterTracker()
    pool = VariantPool("v", [A], RoutingConfig.build("random"), seed=1)
    lease = pool.acquire(None)
    lease.attach(tracker.use(A, "sql"))
    assert tracker.in_flight(A, "sql") == 1
    lease.release()
    lease.release()
    assert tracker.in_flight(A, "sql") == 0


# -- the selector ---------------------------------------------------------------------


def test_selector_components_models_and_errors():
    fleet, cat = make_fleet(InferenceComponents=[{"InferenceComponentName": "ic", "ModelName": "meta/llama",
                                                  "Instances": [A, B]}])
    sel = Selector(cat)
    ep = fleet.endpoint("e")
    s = sel.select(ep, component="ic", model="anything")
    assert s.pool is ep.component("ic") and s.component == "ic" and s.only is None
    s = sel.select(ep, model="meta/llama")  # the OpenAI API names a component by its model
    assert s.pool is ep.component("ic")
    cat.set(A, parse_model_list(vllm_models("meta/llama", "sql")))
    s = sel.select(ep, model="sql")  # ... or by an adapter of its model
    assert (s.pool, s.adapter, s.only) == (ep.component("ic"), "sql", {A})
    cat.set(A, None)
    with pytest.raises(UnknownComponent):
        sel.select(ep, component="nope")
    with pytest.raises(ComponentRequired, match="X-Amzn-SageMaker-Inference-Component"):
        sel.select(ep, native=True)
    # Nothing listed: a model goes to the unlisted instances (engines without /v1/models).
    s = sel.select(ep, model="qwen")
    assert s.pool is ep.variant() and s.only is None
    cat.set(A, parse_model_list(vllm_models("meta/llama")))
    cat.set(B, parse_model_list(vllm_models("meta/llama")))
    cat.set(C, parse_model_list(vllm_models("qwen")))
    assert sel.select(ep, model="qwen").only == {C}  # C lists it: D, unlisted, is not guessed at
    assert sel.select(ep, model="mistral").only == {D}  # listed nowhere: the unlisted instance
    cat.set(D, parse_model_list(vllm_models("mistral")))
    assert sel.select(ep, model="mistral").only == {D}
    with pytest.raises(UnknownModel, match="The model `gpt-4` does not exist"):
        sel.select(ep, model="gpt-4")
    assert Selector(cat, unknown_model="any").select(ep, model="gpt-4").only is None
    with pytest.raises(ValueError):
        Selector(cat, unknown_model="maybe")


def test_selector_uses_another_variant_that_serves_the_model():
    cfg = FleetConfig.from_mapping({"Endpoints": [{"EndpointName": "e", "ProductionVariants": [
        {"VariantName": "Blue", "Instances": [A, B], "InitialVariantWeight": 1000},
        {"VariantName": "Green", "Instances": [C], "InitialVariantWeight": 0.001}]}]})
    fleet, cat = Fleet(cfg, seed=3), ModelCatalog()
    for i in (A, B):
        cat.set(i, parse_model_list(vllm_models("llama")))
    cat.set(C, parse_model_list(vllm_models("qwen")))
    sel = Selector(cat)
    assert all(sel.select(fleet.endpoint("e"), model="qwen").pool.name == "Green" for _ in range(20))
    with pytest.raises(UnknownModel):
        sel.select(fleet.endpoint("e"), model="qwen", variant="Blue")  # targeted: no fallback


def test_selector_sticky_sets_and_autoload():
    fleet, cat = make_fleet(LoraAdapters={"Autoload": True, "Adapters": [{"LoraName": "new", "LoraPath": "/n"}]})
    ep = fleet.endpoint("e")
    cat.set(A, parse_model_list(vllm_models("llama", "sql")))
    cat.set(B, parse_model_list(vllm_models("llama", "sql", "chat")))
    cat.set(C, parse_model_list(vllm_models("llama")))
    cat.set(D, parse_model_list(vllm_models("llama")))
    sel = Selector(cat)
    s = sel.select(ep, model="sql")
    assert (s.adapter, s.parent, s.only) == ("sql", "llama", {A, B})
    assert sel.select(ep, model="llama").only is None and sel.select(ep, model="llama").adapter is None
    s = sel.select(ep, model="new")  # declared, loaded nowhere: an empty sticky set to grow
    assert (s.adapter, s.only) == ("new", frozenset())
    off, cat2 = make_fleet()
    cat2.set(A, parse_model_list(vllm_models("llama")))
    for i in (B, C, D):
        cat2.set(i, parse_model_list(vllm_models("llama")))
    with pytest.raises(UnknownModel):  # without autoload an adapter loaded nowhere is unknown
        Selector(cat2).select(off.endpoint("e"), model="new")


# -- load planning ----------------------------------------------------------------------


class Clock:
    """A monotonic clock a test moves by hand (seconds)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_plan_load_prefers_least_loaded_free_slot_then_an_idle_copy():
    fleet, cat = make_fleet()
    pool = fleet.endpoint("e").variant()
    clock = Clock()
    tracker = AdapterTracker(clock)
    cat.set(A, parse_model_list(vllm_models("llama", "a1", "a2"), max_lora=2))  # full
    cat.set(B, parse_model_list(vllm_models("llama", "a3"), max_lora=2))  # one free slot
    cat.set(C, parse_model_list(vllm_models("qwen"), max_lora=2))  # another base model
    cat.set(D, parse_model_list(vllm_models("llama", "x"), max_lora=2))  # the adapter already there
    plan = plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=30)
    assert (plan.instance_id, plan.evict) == (B, None)
    pool.get(B).add_in_flight(3)  # B busier: A wins only once one of its adapters (both last copies) is idle
    tracker.use(A, "a2").release()  # at 1000 s
    clock.t = 1001.0
    tracker.use(A, "a1").release()  # at 1001 s: a2 is the least recently used
    clock.t = 1020.0  # nothing in flight on A, but both used within 30 s: not idle
    assert plan_load("x", "/x", "llama", [pool.get(A)], cat, tracker, idle_s=30) is None
    assert plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=30).instance_id == B
    clock.t = 1030.5  # a2 unused for 30.5 s, a1 for 29.5 s
    assert plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=31).instance_id == B
    plan = plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=30)
    assert (plan.instance_id, plan.evict, plan.parent) == (A, "a2", "llama")
    clock.t = 1031.0  # both idle now: the least recently used goes
    assert plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=30).evict == "a2"
    held = tracker.use(A, "a2")  # a request in flight: a2 stays however long it runs
    clock.t = 1200.0
    assert plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=30).evict == "a1"
    held_a1 = tracker.use(A, "a1")
    assert plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=30).instance_id == B
    held.release()  # a2's long request ended at 1200 s: idle from then on, not from its start
    held_a1.release()
    clock.t = 1229.0
    assert tracker.idle_for(A, "a2") == 29.0
    assert plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=30).instance_id == B
    clock.t = 1230.0
    assert plan_load("x", "/x", "llama", pool.instances, cat, tracker, idle_s=30).instance_id == A
    tracker.loading["x"] = B  # one load of an adapter at a time
    assert plan_load("x", "/x", "llama", pool.instances, cat, tracker) is None
    assert plan_load("y", "/y", "mistral", pool.instances, cat, tracker) is None  # no base anywhere


def test_a_hot_adapters_only_copy_is_not_unloaded_between_two_of_its_requests():
    # The review's case: the hottest adapter had nothing in flight at one instant and its
    # only copy was unloaded for an adapter loaded nowhere (its next requests: 429s).
    fleet, cat = make_fleet()
    pool = fleet.endpoint("e").variant()
    clock = Clock()
    tracker = AdapterTracker(clock)
    cat.set(A, parse_model_list(vllm_models("llama", "hot"), max_lora=1))
    for i in (B, C, D):
        cat.set(i, parse_model_list(vllm_models("qwen")))
    clock.t += 61.0  # the default IdleSeconds (LoadTimeoutSeconds' default, 60) since the router started
    tracker.use(A, "hot").release()  # a request every few milliseconds ...
    clock.t += 0.004
    assert tracker.in_flight(A, "hot") == 0 and tracker.idle_for(A, "hot") == pytest.approx(0.004)
    assert plan_load("cold", "/c", "llama", pool.instances, cat, tracker) is None  # ... so no: the 429
    clock.t += 59.9
    assert plan_load("cold", "/c", "llama", pool.instances, cat, tracker) is None
    clock.t += 0.1  # 60 s without a request: idle
    assert plan_load("cold", "/c", "llama", pool.instances, cat, tracker).evict == "hot"
    assert plan_load("cold", "/c", "llama", pool.instances, cat, tracker, evictable=lambda a: a != "hot") is None


def test_a_copy_never_used_counts_from_the_start_and_a_loaded_one_as_used():
    fleet, cat = make_fleet()
    pool = fleet.endpoint("e").variant()
    clock = Clock()
    tracker = AdapterTracker(clock)  # a router that has just started: "old" may be hot, it has not seen yet
    cat.set(A, parse_model_list(vllm_models("llama", "old"), max_lora=1))
    clock.t += 9.9
    assert plan_load("new", "/n", "llama", [pool.get(A)], cat, tracker, idle_s=10) is None
    clock.t += 0.1
    assert plan_load("new", "/n", "llama", [pool.get(A)], cat, tracker, idle_s=10).evict == "old"
    tracker.loaded(A, "old")  # (loaded again by the router: used now)
    assert plan_load("new", "/n", "llama", [pool.get(A)], cat, tracker, idle_s=10) is None
    tracker.forget(A, "old")  # unloaded: its marks go, a later copy counts from the start again
    assert tracker.last_used(A, "old") == 0 and tracker.idle_for(A, "old") == 10.0


def test_a_spare_copy_in_use_goes_only_to_place_an_adapter_loaded_nowhere():
    fleet, cat = make_fleet()
    pool = fleet.endpoint("e").variant()
    a, b, c = pool.get(A), pool.get(B), pool.get(C)
    clock = Clock()
    tracker = AdapterTracker(clock)
    cat.set(A, parse_model_list(vllm_models("llama", "a1", "a2"), max_lora=2))
    cat.set(B, parse_model_list(vllm_models("llama", "a1"), max_lora=1))
    cat.set(C, parse_model_list(vllm_models("llama", "sql"), max_lora=1))
    b_a1 = tracker.use(B, "a1")  # B: full, its only adapter in flight
    c_sql = tracker.use(C, "sql")  # C too (sql's set, saturated)
    clock.t += 100.0
    tracker.use(A, "a2").release()  # at 1100 s
    clock.t += 1.0
    tracker.use(A, "a1").release()  # at 1101 s: neither idle (30 s)
    # "new", loaded nowhere: a1's copy on A is a spare (B has it too): it goes, though used last
    plan = plan_load("new", "/n", "llama", [a, b, c], cat, tracker, idle_s=30)
    assert (plan.instance_id, plan.evict) == (A, "a1")
    # a saturated set (sql, on C) does not shrink a set in use: its requests queue within it
    assert plan_load("sql", "/s", "llama", [a, b, c], cat, tracker, idle_s=30, empty=False) is None
    # B down: A's copy of a1 is its last healthy one; a2's is its last too: nothing may go
    assert plan_load("new", "/n", "llama", [a, c], cat, tracker, idle_s=30) is None
    clock.t += 29.5  # a2 idle (30.5 s), a1 not (29.5 s)
    plan = plan_load("sql", "/s", "llama", [a, b, c], cat, tracker, idle_s=30, empty=False)
    assert (plan.instance_id, plan.evict) == (A, "a2")  # a saturated set grows into an idle adapter's slot
    plan = plan_load("new", "/n", "llama", [a, b, c], cat, tracker, idle_s=30)
    assert plan.evict == "a2"  # an idle copy before a spare one in use
    clock.t += 1.0  # both idle: the spare one (a1's set shrinks, a2's is not emptied), though a2 is older
    assert plan_load("new", "/n", "llama", [a, b, c], cat, tracker, idle_s=30).evict == "a1"
    assert plan_load("sql", "/s", "llama", [a, b, c], cat, tracker, idle_s=30, empty=False).evict == "a1"
    b_a1.release()
    c_sql.release()


def test_plan_load_ties_are_the_same_on_every_replica():
    cat = ModelCatalog()
    ids = [f"http://10.1.0.{i}:8000" for i in range(8)]
    for i in ids:
        cat.set(i, parse_model_list(vllm_models("llama"), max_lora=1))
    pools = [VariantPool("v", ids, RoutingConfig.build("random"), seed=s) for s in range(3)]
    picks = {plan_load("ad-7", "/p", "llama", p.instances, cat, AdapterTracker()).instance_id for p in pools}
    assert len(picks) == 1
    spread = {plan_load(f"ad-{k}", "/p", "llama", pools[0].instances, cat, AdapterTracker()).instance_id
              for k in range(40)}
    assert len(spread) >= 5  # different adapters start on different instances


# -- keys of every OpenAI route ------------------------------------------------------------


def test_component_takes_part_in_the_key():
    routing = RoutingConfig.build("prefix-aware", 1024, 4)
    body = {"model": "m", "messages": [{"role": "user", "content": "same prompt " * 20}]}
    k1 = openai_route(scoped_model(body, "ic-a"), True, routing)[0]
    k2 = openai_route(scoped_model(body, "ic-b"), True, routing)[0]
    k0 = openai_route(body, True, routing)[0]
    assert len({k0, k1, k2}) == 3
    assert openai_route(scoped_model(body, "ic-a"), True, routing)[0] == k1
    assert scoped_model(body, None) is body


def test_every_route_keys_on_its_own_input():
    routing = RoutingConfig.build("prefix-aware", 1024, 4)
    doc = "a long shared document " * 80

    def key(route: OpenAIRoute, payload: dict) -> int | None:
        view, chat = keyed_view(payload, route)
        return None if view is None else openai_route(view, chat, routing)[0]

    completion = key(OpenAIRoute.COMPLETIONS, {"model": "m", "prompt": doc})
    assert key(OpenAIRoute.EMBEDDINGS, {"model": "m", "input": doc}) == completion
    assert key(OpenAIRoute.EMBEDDINGS, {"model": "m", "input": [doc, "other"]}) == completion
    assert key(OpenAIRoute.TOKENIZE, {"model": "m", "prompt": doc}) == completion
    assert key(OpenAIRoute.DETOKENIZE, {"model": "m", "tokens": [1, 2, 3]}) == \
        key(OpenAIRoute.COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]})
    # no tokens (vLLM answers an empty text): keyed as an empty prompt, not refused
    assert key(OpenAIRoute.DETOKENIZE, {"model": "m", "tokens": []}) == \
        key(OpenAIRoute.COMPLETIONS, {"model": "m", "prompt": ""})
    chat = key(OpenAIRoute.CHAT, {"model": "m", "messages": [{"role": "system", "content": doc},
                                                            {"role": "user", "content": "q"}]})
    assert key(OpenAIRoute.RESPONSES, {"model": "m", "instructions": doc, "input": "q"}) == chat
    assert key(OpenAIRoute.RESPONSES, {"model": "m", "instructions": doc, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]}]}) == chat
    # Same query and documents share a key; a different query does not.
    r1 = key(OpenAIRoute.RERANK, {"model": "m", "query": doc, "documents": ["x", "y"]})
    assert r1 == key(OpenAIRoute.RERANK, {"model": "m", "query": doc, "documents": [{"text": "x"}, "y"]})
    assert r1 != key(OpenAIRoute.RERANK, {"model": "m", "query": "other " + doc, "documents": ["x", "y"]})
    assert key(OpenAIRoute.SCORE, {"model": "m", "text_1": doc, "text_2": ["a"]}) == \
        key(OpenAIRoute.SCORE, {"model": "m", "queries": doc, "documents": ["a"]})
    assert key(OpenAIRoute.OTHER, {"model": "m"}) is None
    # a tenant separates them as on chat
    assert key(OpenAIRoute.EMBEDDINGS, {"model": "m", "input": doc, "prompt_cache_key": "t"}) != completion


@pytest.mark.parametrize("route, payload, needle", [
    (OpenAIRoute.EMBEDDINGS, {"model": "m"}, "'input' is required"),
    (OpenAIRoute.EMBEDDINGS, {"model": "m", "input": {"x": 1}}, "'input' must be a string"),
    (OpenAIRoute.RESPONSES, {"model": "m"}, "'input' is required"),
    (OpenAIRoute.RESPONSES, {"model": "m", "input": "q", "instructions": 3}, "'instructions' must be a string"),
    (OpenAIRoute.RERANK, {"model": "m", "query": "q"}, "'query' and 'documents' are required"),
    (OpenAIRoute.RERANK, {"model": "m", "query": "q", "documents": "d"}, "'documents' must be a list"),
    (OpenAIRoute.SCORE, {"model": "m", "text_1": "a"}, "'text_1' and 'text_2' are required"),
    (OpenAIRoute.DETOKENIZE, {"model": "m", "tokens": "abc"}, "'tokens' must be a list of token ids"),
])
def test_route_input_errors(route, payload, needle):
    from prefixroute.core.keys import InvalidRequest

    routing = RoutingConfig.build("prefix-aware", 1024, 4)
    with pytest.raises(InvalidRequest, match=needle):
        view, chat = keyed_view(payload, route)
        openai_route(view, chat, routing)


def test_route_for_path():
    assert route_for_path("/v1/chat/completions") is OpenAIRoute.CHAT
    assert route_for_path("/v1/embeddings") is OpenAIRoute.EMBEDDINGS
    assert route_for_path("/tokenize") is OpenAIRoute.TOKENIZE
    assert route_for_path("/v1/audio/speech") is OpenAIRoute.OTHER
    assert route_for_path("/metrics") is None
    assert OpenAIRoute.RESPONSES.streams and not OpenAIRoute.EMBEDDINGS.streams


def test_served_models_copies_are_independent():
    s = ServedModels(("llama",))
    t = s.with_adapter("a", "llama", "/a")
    assert s.adapters == {} and t.adapters == {"a": "llama"} and t.without_adapter("a").adapters == {}
    assert [c["id"] for c in t.cards] == ["a"] and t.roots == {"a": "/a"}


def test_an_adapter_loaded_on_no_copy_of_a_component_is_unknown_without_autoload():
    # A declared adapter of a component's model, loaded on none of its copies, and no
    # Autoload: an unknown model (404 model_not_found), never a request to a copy that
    # does not have it, whether the component is named by its model or by header/path.
    fleet, cat = make_fleet(InferenceComponents=[{"InferenceComponentName": "ic", "ModelName": "meta/llama",
                                                  "Instances": [A, B]}],
                            LoraAdapters={"Adapters": [{"LoraName": "sql", "LoraPath": "/a/sql",
                                                        "BaseModelName": "meta/llama"}]})
    ep = fleet.endpoint("e")
    sel = Selector(cat)
    for i in (A, B):
        cat.set(i, parse_model_list(vllm_models("meta/llama")))
    with pytest.raises(UnknownModel, match="sql"):
        sel.select(ep, model="sql")
    with pytest.raises(UnknownModel, match="sql"):
        sel.select(ep, component="ic", model="sql")
    cat.set(C, parse_model_list(vllm_models("meta/llama", "other")))  # an adapter listed outside the component
    with pytest.raises(UnknownModel, match="other"):
        sel.select(ep, component="ic", model="other")
    cat.set(B, parse_model_list(vllm_models("meta/llama", "sql")))  # loaded on a copy: its sticky set
    s = sel.select(ep, component="ic", model="sql")
    assert (s.pool, s.adapter, s.only) == (ep.component("ic"), "sql", {B})
    assert sel.select(ep, component="ic", model="anything").only is None  # not an adapter: every copy
