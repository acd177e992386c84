"""The AsyncAPI document's YAML has no generated anchors: a schema used twice is written twice, so that a change to
one service's contract shows in a diff as that change only (PyYAML's `&id062` numbering shifts with any change)."""

from __future__ import annotations

import re

import yaml

from shared.tools.asyncapi import build_document, render_yaml


def test_no_anchors_or_aliases_and_the_same_document() -> None:
    doc = build_document()
    text = render_yaml(doc)
    assert not re.search(r"(&|\*)id\d+", text)
    assert yaml.safe_load(text) == doc
