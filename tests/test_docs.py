"""The documentation names only what exists and documents every setting it names."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pydantic import BaseModel

from prefixroute.cli import build_parser
from prefixroute.core.config import (CacheAwareRoutingConfig, EndpointConfig, FleetConfig, PrefixAwareRoutingConfig,
                                     RoutingConfig, VariantConfig)
from prefixroute.server.clientkeys import ApiKey, KeysConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGURATION = (ROOT / "docs" / "CONFIGURATION.md").read_text()


def _helps() -> dict[str, str]:
    """Every subcommand's --help text."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sp.format_help() for name, sp in subs.choices.items()}


def test_every_serve_flag_is_in_the_configuration_reference():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = [a.option_strings[0] for a in serve._actions if a.option_strings and a.option_strings[0] != "-h"]
    assert len(flags) > 40
    missing = [f for f in flags if f"`{f}" not in CONFIGURATION]
    assert missing == []


def test_every_yaml_field_is_in_the_configuration_reference():
    models: list[type[BaseModel]] = [FleetConfig, EndpointConfig, VariantConfig, RoutingConfig,
                                     PrefixAwareRoutingConfig, CacheAwareRoutingConfig, KeysConfig, ApiKey]
    fields = {f.alias for m in models for f in m.model_fields.values() if f.alias}
    assert {"PrefixLength", "LoadWeight", "KeySha256", "Defaults"} <= fields
    missing = sorted(f for f in fields if f"`{f}`" not in CONFIGURATION)
    assert missing == []


def test_every_document_named_exists():
    named: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # markdown links
            if not target.startswith(("http://", "https://", "mailto:")):
                named.setdefault(str((doc.parent / target).resolve().relative_to(ROOT)), set()).add(doc.name)
        for target in re.findall(r"\b((?:docs|bench|tests|examples|src)/[\w./-]+\.(?:md|py|yaml|json|png))", text):
            named.setdefault(target, set()).add(doc.name)
    for name, text in _helps().items():
        for target in re.findall(r"\b(docs/[\w./-]+\.md)", text):
            named.setdefault(target, set()).add(f"prefixroute {name} --help")
    assert len(named) > 20
    missing = {t: sorted(by) for t, by in named.items() if not (ROOT / t).exists()}
    assert missing == {}


def test_anchors_of_links_between_documents_exist():
    def anchors(text: str) -> set[str]:
        out = set()
        for title in re.findall(r"^#+ (.+)$", text, re.M):
            slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            out.add(slug)
        return out

    broken = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text()):
            path = (doc.parent / target) if target else doc
            if path.suffix == ".md" and anchor not in anchors(path.read_text()):
                broken.append(f"{doc.name} -> {target}#{anchor}")
    assert broken == []
