"""Orchestrators give the server time to drain: compose's stop_grace_period and Kubernetes'
terminationGracePeriodSeconds are at least its shutdown grace plus what exiting takes after it."""

from __future__ import annotations

from pathlib import Path

import yaml

from gpuscope.kube.render import OVERLAYS
from gpuscope.server.http_settings import HttpLimits
from gpuscope.server.main import build_parser
from gpuscope.server.shutdown import EXIT_AFTER_GRACE_S
from gpuscope.util.flags import parse_duration

ROOT = Path(__file__).resolve().parents[1]


def _grace(serve_argv: list[str]) -> float:
    """The --shutdown.grace these ``gpuscope serve`` arguments run with."""
    args = serve_argv[1:] if serve_argv[:1] == ["serve"] else serve_argv
    return build_parser().parse_settings(args).http.shutdown_grace_s


def test_parser_default_is_the_settings_default():
    assert _grace([]) == HttpLimits().shutdown_grace_s


def test_compose_waits_for_the_server_to_drain():
    server = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["server"]
    stop_grace = parse_duration(server["stop_grace_period"])
    assert stop_grace >= _grace(server["command"]) + EXIT_AFTER_GRACE_S, stop_grace


def test_kubernetes_waits_for_the_server_to_drain():
    for overlay in OVERLAYS:  # the deployments of the server (add-ons such as share deploy other parts)
        path = ROOT / "deploy/kubernetes/rendered" / f"{overlay}.yaml"
        deployments = [d for d in yaml.safe_load_all(path.read_text())
                       if d and d.get("kind") == "Deployment" and d["metadata"]["name"] == "gpuscope-server"]
        assert len(deployments) == 1, path
        pod = deployments[0]["spec"]["template"]["spec"]
        container = next(c for c in pod["containers"] if c["name"] == "server")
        grace = _grace(container["args"])
        assert pod["terminationGracePeriodSeconds"] >= grace + EXIT_AFTER_GRACE_S, path
