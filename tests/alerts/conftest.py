"""Fixtures for the alert tests: a real Alertmanager on 127.0.0.1 and a webhook sink it posts to."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from gpuscope.ops import procs
from gpuscope.util.freeport import free_port
from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[2]


def alertmanager_binary() -> str:
    """Debian names it prometheus-alertmanager; upstream tarballs name it alertmanager."""
    return shutil.which("alertmanager") or require_binary("prometheus-alertmanager")


@dataclass
class Sink:
    """Webhook notifications received, in order (the receiver's role, minus everything else)."""

    url: str
    notifications: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> list[dict]:
        with self.lock:
            return list(self.notifications)


@pytest.fixture
def sink() -> Iterator[Sink]:
    holder: list[Sink] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with holder[0].lock:
                holder[0].notifications.append(json.loads(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Sink(f"http://127.0.0.1:{server.server_address[1]}/alerts"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield holder[0]
    server.shutdown()
    server.server_close()


@dataclass
class Alertmanager:
    url: str

    def post(self, alerts: list[dict]) -> None:
        response = requests.post(f"{self.url}/api/v2/alerts", json=alerts, timeout=5)
        assert response.status_code == 200, response.text

    def alerts(self) -> list[dict]:
        return requests.get(f"{self.url}/api/v2/alerts", timeout=5).json()

    def groups(self) -> list[dict]:
        return requests.get(f"{self.url}/api/v2/alerts/groups", timeout=5).json()


def start_alertmanager(config_text: str, tmp_path: Path) -> Iterator[Alertmanager]:
    """Run a real Alertmanager with this configuration until the generator is closed."""
    binary = alertmanager_binary()
    config = tmp_path / "alertmanager.yml"
    config.write_text(config_text)
    port = free_port()
    am = Alertmanager(f"http://127.0.0.1:{port}")
    child = procs.Child([binary, f"--config.file={config}", f"--storage.path={tmp_path / 'data'}",
                         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                        name="alertmanager", log_path=tmp_path / "alertmanager.log",
                        ready=f"{am.url}/-/ready", grace_s=10)
    with child:
        try:
            child.wait_ready(30)
        except procs.ChildError as exc:
            pytest.fail(str(exc))
        yield am
