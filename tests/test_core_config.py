"""Configuration is validated at the edge; errors name the field, the value and the range."""

import pytest

from prefixroute.core.config import (
    ConfigError,
    FleetConfig,
    PrefixAwareRoutingConfig,
    RoutingConfig,
    RoutingStrategy,
    parse_model,
)


@pytest.mark.parametrize("spelling", ["PREFIX_AWARE", "prefix_aware", "prefix-aware", "Prefix-Aware", " prefix-aware "])
def test_strategy_spellings(spelling):
    assert RoutingStrategy.parse(spelling) is RoutingStrategy.PREFIX_AWARE


def test_strategy_cli_name():
    assert RoutingStrategy.LEAST_OUTSTANDING_REQUESTS.cli_name == "least-outstanding-requests"


def test_unknown_strategy_lists_known():
    with pytest.raises(ConfigError) as exc:
        RoutingStrategy.parse("round-robin")
    assert "round-robin" in str(exc.value)
    assert "LEAST_OUTSTANDING_REQUESTS" in str(exc.value)


@pytest.mark.parametrize(
    "prefix_length, threshold, needle",
    [
        (1023, 10, "PrefixLength: 1,023 is out of range (allowed 1,024-65,536)"),
        (65537, 10, "PrefixLength: 65,537 is out of range (allowed 1,024-65,536)"),
        (4096, 0, "ConcurrencyThreshold: 0 is out of range (allowed 1-1,024)"),
        (4096, 1025, "ConcurrencyThreshold: 1,025 is out of range (allowed 1-1,024)"),
    ],
)
def test_out_of_range_names_field_value_and_range(prefix_length, threshold, needle):
    with pytest.raises(ConfigError) as exc:
        RoutingConfig.build("prefix-aware", prefix_length, threshold)
    assert needle in str(exc.value)


@pytest.mark.parametrize("prefix_length, threshold", [(1024, 1), (65536, 1024), (4096, 10)])
def test_bounds_inclusive(prefix_length, threshold):
    cfg = RoutingConfig.build("prefix-aware", prefix_length, threshold)
    assert cfg.prefix_aware == PrefixAwareRoutingConfig(prefix_length=prefix_length, concurrency_threshold=threshold)


def test_prefix_aware_requires_both_settings():
    with pytest.raises(ConfigError, match="required with RoutingStrategy PREFIX_AWARE"):
        RoutingConfig.build("prefix-aware")
    with pytest.raises(ConfigError, match="ConcurrencyThreshold: is required"):
        RoutingConfig.build("prefix-aware", prefix_length=4096)


def test_non_integer_rejected():
    with pytest.raises(ConfigError, match="'4k' is not an integer"):
        parse_model(RoutingConfig, {"RoutingStrategy": "PREFIX_AWARE",
                                      "PrefixAwareRoutingConfig": {"PrefixLength": "4k", "ConcurrencyThreshold": 1}})
    with pytest.raises(ConfigError, match="True is not an integer"):
        RoutingConfig.build("prefix-aware", True, 3)


def test_config_is_immutable():
    cfg = RoutingConfig.build("prefix-aware", 4096, 8)
    with pytest.raises(Exception):
        cfg.strategy = RoutingStrategy.RANDOM  # type: ignore[misc]


def test_default_strategy_is_random():
    assert RoutingConfig().strategy is RoutingStrategy.RANDOM


def test_api_shape_round_trip():
    cfg = RoutingConfig.build("prefix-aware", 8192, 16)
    assert cfg.to_api() == {"RoutingStrategy": "PREFIX_AWARE",
                            "PrefixAwareRoutingConfig": {"PrefixLength": 8192, "ConcurrencyThreshold": 16}}
    assert RoutingConfig.model_validate(cfg.to_api()) == cfg


YAML = """
Endpoints:
  - EndpointName: chat
    ProductionVariants:
      - VariantName: blue
        InitialVariantWeight: 3
        Instances: ["http://127.0.0.1:8001/", "http://127.0.0.1:8002"]
        RoutingConfig:
          RoutingStrategy: PREFIX_AWARE
          PrefixAwareRoutingConfig: {PrefixLength: 4096, ConcurrencyThreshold: 8}
      - VariantName: green
        Instances: ["http://127.0.0.1:8003"]
"""


def test_yaml_fleet():
    fleet = FleetConfig.from_yaml(YAML)
    ep = fleet.endpoints[0]
    assert ep.name == "chat"
    assert [v.name for v in ep.variants] == ["blue", "green"]
    assert ep.variants[0].instances == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert ep.variants[0].weight == 3
    assert ep.variants[0].routing.prefix_aware.concurrency_threshold == 8
    assert ep.variants[1].routing.strategy is RoutingStrategy.RANDOM


def test_yaml_errors_give_the_path():
    bad = YAML.replace("PrefixLength: 4096", "PrefixLength: 10").replace("http://127.0.0.1:8003", "ftp://x")
    with pytest.raises(ConfigError) as exc:
        FleetConfig.from_yaml(bad)
    msg = str(exc.value)
    assert ("Endpoints.0.ProductionVariants.0.RoutingConfig.PrefixAwareRoutingConfig.PrefixLength: "
            "10 is out of range (allowed 1,024-65,536)") in msg
    assert "Endpoints.0.ProductionVariants.1.Instances: 'ftp://x' is not an http:// or https:// URL" in msg


def test_yaml_unknown_setting_and_syntax():
    with pytest.raises(ConfigError, match="Bogus: is not a known setting"):
        FleetConfig.from_yaml(YAML.replace("InitialVariantWeight: 3", "Bogus: 3"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        FleetConfig.from_yaml("Endpoints: [")


def test_duplicate_instances_rejected():
    with pytest.raises(ConfigError, match="duplicate instance URL 'http://a:1'"):
        FleetConfig.single(["http://a:1", "http://a:1/"], RoutingConfig())
    many = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(10_000)]
    with pytest.raises(ConfigError) as exc:  # one repeat among 10,000: named, not the whole list
        FleetConfig.single([*many, many[7]], RoutingConfig())
    assert str(exc.value).endswith("duplicate instance URL 'http://10.0.0.7:8000'") and len(str(exc.value)) < 300


@pytest.mark.parametrize("doc, needle", [
    ("", "must be a mapping with an 'Endpoints' list (got an empty document)"),
    ("[1, 2]", "(got list [1, 2])"),
    ("Endpoints: 5", "Endpoints: must be a list (got int 5)"),
    (YAML.replace("InitialVariantWeight: 3", "InitialVariantWeight: 0"), "greater than 0 (got 0)"),
])
def test_document_shape_errors(doc, needle):
    with pytest.raises(ConfigError) as exc:
        FleetConfig.from_yaml(doc)
    assert needle in str(exc.value)


def test_a_list_of_many_wrong_items_names_the_first_ten_and_counts_the_rest():
    doc = YAML.replace('Instances: ["http://127.0.0.1:8001/", "http://127.0.0.1:8002"]',
                       "Instances: [" + ", ".join(["[1]"] * 1000) + "]")
    assert doc != YAML
    with pytest.raises(ConfigError) as exc:
        FleetConfig.from_yaml(doc)
    msg = str(exc.value)
    clauses = msg.split("; ")
    assert len(clauses) == 11 and clauses[-1] == "... and 990 more problems", msg[:300]
    assert clauses[0] == "Endpoints.0.ProductionVariants.0.Instances.0: Input should be a valid string"
    assert len(msg) < 2000
    with pytest.raises(ConfigError) as exc:  # one problem whose value is long: quoted in part
        FleetConfig.from_yaml(YAML.replace("InitialVariantWeight: 3", "InitialVariantWeight: 3\n        Bogus: "
                                           + "v" * 5000))
    assert f"Bogus: is not a known setting (value '{'v' * 56}...)" in str(exc.value)
    assert len(str(exc.value)) < 200


def test_the_applied_configuration_line_names_twenty_changes_and_counts_the_rest():
    from prefixroute.server.state import describe_changes

    one_doc = ("Endpoints:\n  - EndpointName: e0\n    ProductionVariants:\n      - VariantName: v\n"
               "        Instances: [\"http://127.0.0.1:9000\"]\n")
    one = FleetConfig.from_yaml(one_doc)
    doc = "Endpoints:\n" + "".join(
        f"  - EndpointName: e{i}\n    ProductionVariants:\n      - VariantName: v\n"
        f"        Instances: [\"http://127.0.0.1:{9000 + i}\"]\n" for i in range(26))
    parts = describe_changes(one, FleetConfig.from_yaml(doc)).split("; ")
    assert len(parts) == 21 and all(p.endswith("added (1 variant(s), 1 instance(s))") for p in parts[:20])
    assert parts[-1] == "... and 5 more changes"
    assert describe_changes(one, one) == "no change"
    kv = "KvEvents:\n  Tokenizer: tiny\n  Discovery: {FromInfo: true}\n"
    with_kv = FleetConfig.from_yaml(one_doc + kv)
    tokens = FleetConfig.from_yaml(one_doc + kv + "  Matching: tokens\n")
    assert describe_changes(one, with_kv) == "KvEvents added"
    assert describe_changes(with_kv, tokens) == "KvEvents changed"  # (only how requests are matched)
    assert describe_changes(tokens, one) == "KvEvents removed"


def test_the_applied_configuration_line_says_what_changed():
    from prefixroute.server.state import describe_changes

    old = FleetConfig.from_yaml(YAML)
    text = YAML.replace("PrefixLength: 4096", "PrefixLength: 8192").replace("InitialVariantWeight: 3",
                                                                             "InitialVariantWeight: 2")
    new = FleetConfig.from_yaml(text)
    said = describe_changes(old, new)
    assert "routing PREFIX_AWARE PrefixLength=4096" in said and "-> PREFIX_AWARE PrefixLength=8192" in said
    assert "weight 3 -> 2" in said


def test_yaml_errors_name_the_file_and_line():
    with pytest.raises(ConfigError) as err:
        FleetConfig.from_yaml("Endpoints:\n  - EndpointName: a\n    ProductionVariants: [\n", source="fleet.yaml")
    assert str(err.value).startswith("fleet.yaml line 4, column 1: not valid YAML")
    bad = YAML.replace("PrefixLength: 4096", "PrefixLength: 100")
    with pytest.raises(ConfigError) as err:
        FleetConfig.from_yaml(bad, source="fleet.yaml")
    line = bad.splitlines().index(next(x for x in bad.splitlines() if "PrefixLength: 100" in x)) + 1
    assert str(err.value).startswith(f"fleet.yaml line {line}: Endpoints.0.ProductionVariants.0.RoutingConfig."
                                     "PrefixAwareRoutingConfig.PrefixLength: 100 is out of range")


def test_the_applied_configuration_line_names_component_changes():
    from prefixroute.server.state import describe_changes

    doc = ("Endpoints:\n  - EndpointName: llm\n    ProductionVariants:\n      - VariantName: v\n"
           "        Instances: [\"http://127.0.0.1:9000\", \"http://127.0.0.1:9001\"]\n"
           "    InferenceComponents:\n      - InferenceComponentName: qwen\n        ModelName: q\n"
           "        Instances: DISCOVER\n{routing}")
    old = FleetConfig.from_yaml(doc.format(routing=""))
    new = FleetConfig.from_yaml(doc.format(routing="        RoutingConfig: {RoutingStrategy: LEAST_OUTSTANDING_REQUESTS}\n"))
    assert describe_changes(old, new) == "llm/component qwen routing its variant's -> LEAST_OUTSTANDING_REQUESTS"
    gone = FleetConfig.from_yaml(doc.split("    InferenceComponents")[0])
    assert describe_changes(old, gone) == "llm/component qwen removed"
    assert describe_changes(gone, old) == "llm/component qwen added"
