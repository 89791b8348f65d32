"""The committed dashboard JSON and datasource file are exactly what the dashboard modules render."""

from __future__ import annotations

from gpuscope.dashboards import render
from tests.dashboards.panels import ROOT


def test_committed_files_match_a_fresh_generation():
    stale = [rel for rel, text in render.outputs().items()
             if not (ROOT / rel).exists() or (ROOT / rel).read_text() != text]
    assert not stale, f"stale generated files {stale}: run `gpuscope generate` and commit"


def test_the_json_encoding_needs_no_private_grafanalib_module():
    uid, text = render.dashboard_json("logs")
    assert uid == "gpuscope-logs" and '"type": "logs"' in text
