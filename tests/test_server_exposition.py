"""server/exposition.py: the samples of a metrics page read directly when its lines are
plain, exactly as prometheus_client's parser reads them; anything else is that parser's."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.server.exposition import _plain, samples
from prefixroute.server.scrape import parse_engine_metrics


def _reference(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


def _same(a: list, b: list) -> bool:
    """Equal samples, NaN equal to NaN, names compared without ``_total`` (the parser adds
    it to a counter's samples declared without it)."""
    if len(a) != len(b):
        return False
    for (n1, l1, v1), (n2, l2, v2) in zip(a, b):
        if n1.removesuffix("_total") != n2.removesuffix("_total") or l1 != l2:
            return False
        if not (v1 == v2 or (math.isnan(v1) and math.isnan(v2))):
            return False
    return True


_names = st.sampled_from(["vllm:prefix_cache_queries_total", "vllm:num_requests_running", "sglang:token_usage",
                          "vllm:lora_requests_info", "x", "x_created", "a_b:c"])
_label_names = st.sampled_from(["model_name", "engine", "le", "running_lora_adapters", "max_lora"])
_label_values = st.lists(st.sampled_from(list('ab ,{}="\\n:') + ["\\\\", '\\"', "\\n"]), max_size=12).map("".join)
_values = st.one_of(st.integers(-10**20, 10**20).map(str),
                    st.floats(allow_nan=False, allow_infinity=False).map(repr),
                    st.sampled_from(["NaN", "+Inf", "-Inf", "1e3", "0.0", "-0", "1.5E-7"]))


def _label_value(text: str) -> str:
    """A label value written as an exporter does: quotes and lone backslashes escaped."""
    out, i = [], 0
    while i < len(text):
        two = text[i:i + 2]
        if two in ("\\\\", '\\"', "\\n"):
            out.append(two)
            i += 2
            continue
        out.append({"\\": "\\\\", '"': '\\"'}.get(text[i], text[i]))
        i += 1
    return "".join(out)


@st.composite
def _pages(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        name = draw(_names)
        if draw(st.booleans()):
            lines.append(f"# HELP {name} some help text, with {{braces}}, = and a backslash \\\\")
        if draw(st.booleans()):
            lines.append(f"# TYPE {name} {draw(st.sampled_from(['counter', 'gauge', 'untyped']))}")
        keys = draw(st.lists(_label_names, unique=True, max_size=3))
        labels = ",".join(f'{k}="{_label_value(draw(_label_values))}"' for k in keys)
        sample = name + (f"{{{labels}}}" if keys or draw(st.booleans()) else "") + " " + draw(_values)
        if draw(st.booleans()):
            sample += f" {draw(st.integers(0, 2 * 10**12))}"
        lines.append(sample)
        if draw(st.booleans()):
            lines.append("# a comment")
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(_pages())
def test_plain_pages_are_read_directly_as_the_parser_reads_them(page: str):
    direct = _plain(page.splitlines())
    assert direct is not None, page  # the fast path took it
    assert _same(direct, _reference(page)), page
    assert _same(samples(page), _reference(page))


@pytest.mark.parametrize("page", [
    'x\t1\n',  # a tab
    'x{a="1", b="2"} 3\n',  # a space after a comma
    'x {a="1"} 3\n',  # a space before the labels
    '# HELP "quoted:name" help\n{"quoted:name"} 1\n',  # a quoted (UTF-8) metric name
    'x{a="1",} 1\n',  # a trailing comma
    'x 1 2 3\n',  # three numbers: the parser takes the first and the last
    'x 3 2' + '0' * 308 + '\n',  # a timestamp beyond a float (the parser divides the int by 1,000)
    '# HELP x help with "quotes"\nx 1\n',  # quotes in a comment: the parser splits them its way
])
def test_other_lines_go_to_the_parser_whole(page: str):
    assert _plain(page.splitlines()) is None
    assert _same(samples(page), _reference(page))


@pytest.mark.parametrize("page", [
    'x{a="1",a="2"} 1\n',  # a duplicate label
    'x{__a="1"} 1\n',  # a reserved label name
    'x 1_000\n',  # a value the parser refuses
    'x abc\n',
    'x 1 notatime\n',
    '# TYPE x\nx 1\n',  # a TYPE line without a type
    '# HELP 1x help\n',  # an invalid metric name
    'x{a="1} 2\n',  # an unterminated label value
    '#x HELP 1y help\ny 1\n',  # HELP as the second word, an invalid name
    '# HELP\x0c1y help\ny 1\n',  # other white space
])
def test_what_the_parser_refuses_still_raises(page: str):
    assert _plain(page.splitlines()) is None
    with pytest.raises(ValueError):
        _reference(page)
    with pytest.raises(ValueError):
        samples(page)


def test_an_engine_page_gives_the_same_figures_either_way(monkeypatch):
    page = (
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries.\n"
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 1000.0\n'
        'vllm:prefix_cache_queries_total{model_name="m",engine="1"} 500.0\n'
        'vllm:prefix_cache_queries_created{model_name="m",engine="0"} 1.7e9\n'
        "# TYPE vllm:prefix_cache_hits counter\n"  # declared without _total: the parser renames
        'vllm:prefix_cache_hits{model_name="m"} 900.0\n'
        'vllm:num_requests_running{model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{model_name="m"} 2.0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9\n'
    )
    direct = parse_engine_metrics(page, 1.0)
    import prefixroute.server.exposition as exposition

    monkeypatch.setattr(exposition, "_plain", lambda lines: None)  # every page to prometheus_client
    assert parse_engine_metrics(page, 1.0) == direct
    assert (direct.prefix_cache_queries, direct.prefix_cache_hits, direct.requests_running,
            direct.requests_waiting, direct.kv_usage) == (1500.0, 900.0, 3.0, 2.0, 0.25)
    assert direct.lora_adapters == ("a", "b", "c") and direct.max_lora == 4
    assert len(direct.counter_series) == 3


def test_a_value_beyond_a_float_fails_as_it_did():
    """An integer value too large for a float: prometheus_client's parser reads it as an
    int, which cannot become a float; the page still fails (the scrape counts it failed)."""
    page = "vllm:num_requests_running 1" + "0" * 400 + "\n"
    assert _plain(page.splitlines()) is None
    with pytest.raises(OverflowError):
        samples(page)
