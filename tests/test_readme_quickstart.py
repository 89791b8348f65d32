"""README's quick start, verbatim: its first request, against the server as compose and the stack run it.

The curl command is read out of README.md's "Start" section; the server's flags are read out of
docker-compose.yml's server service and out of `gpuscope stack` (``Stack._process``), never re-typed
here. Only addresses change: the server listens on a free local port, compose's Loki URL points at a
local Loki-protocol receiver.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from gpuscope.ops import procs
from gpuscope.ops.stack import Stack, StackOptions
from tests.logs.test_loki_push import Receiver, free_port

ROOT = Path(__file__).resolve().parents[1]


def readme_first_request() -> str:
    """The curl line of the first ```sh block in README's "## Start" section that sends a request."""
    text = (ROOT / "README.md").read_text()
    start = re.search(r"^## Start\n(.*?)(?=^## )", text, re.M | re.S)
    assert start, "README.md has no '## Start' section"
    for block in re.findall(r"^```sh\n(.*?)^```", start.group(1), re.M | re.S):
        for line in block.splitlines():
            if line.lstrip().startswith("curl "):
                return line.strip()
    pytest.fail("README's Start section has no curl command")


def compose_server_argv(listen: str, loki_url: str) -> list[str]:
    """docker-compose.yml's server command (the image's entrypoint is `gpuscope`), addresses localized."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert re.search(r'^ENTRYPOINT \["gpuscope"\]', (ROOT / "Dockerfile").read_text(), re.M)
    command = list(compose["services"]["server"]["command"])
    assert command[0] == "serve"
    args = []
    it = iter(command[1:])
    for arg in it:
        if arg == "--web.listen-address":
            args += [arg, listen]
            next(it)
        elif arg == "--loki.url":
            args += [arg, loki_url]
            next(it)
        else:
            assert "0.0.0.0" not in arg and "loki:" not in arg, f"unhandled address in compose: {arg}"
            args.append(arg)
    return [sys.executable, "-m", "gpuscope", "serve", *args]


def send_readme_request(curl_line: str, base_url: str) -> tuple[int, str]:
    """Run README's curl line with only `localhost:8000` replaced by the test server's address."""
    argv = shlex.split(curl_line)
    assert argv[0] == "curl" and any(a.startswith("localhost:8000/") for a in argv), curl_line
    host = base_url.removeprefix("http://")
    argv = [a.replace("localhost:8000", host, 1) if a.startswith("localhost:8000/") else a for a in argv]
    curl = shutil.which("curl")
    if curl is not None:
        result = subprocess.run([curl, *argv[1:], "--write-out", "\n%{http_code}"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        body, _, status = result.stdout.rpartition("\n")
        return int(status), body
    # No curl on this machine: replay exactly what the line says (-H headers, -d body, POST).
    headers, data, url = {}, None, None
    it = iter(argv[1:])
    for arg in it:
        if arg == "-H":
            name, _, value = next(it).partition(":")
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            data = next(it).encode()
        elif arg == "-s":
            continue
        else:
            url = "http://" + arg
    assert url is not None and data is not None
    request = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/x-www-form-urlencoded", **headers}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def assert_completion(status: int, body: str, curl_line: str) -> None:
    assert status == 200, f"{curl_line!r} answered {status}: {body}"
    answer = json.loads(body)
    assert answer["object"] == "text_completion"
    assert answer["choices"][0]["text"] is not None
    argv = shlex.split(curl_line)
    max_tokens = json.loads(argv[argv.index("-d") + 1])["max_tokens"]
    assert 1 <= answer["usage"]["completion_tokens"] <= max_tokens


def test_readme_request_works_against_the_compose_server(tmp_path):
    curl_line = readme_first_request()
    receiver = Receiver().start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = procs.Child(compose_server_argv(f"127.0.0.1:{port}", receiver.url), name="compose's server",
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, log_path=tmp_path / "serve.log",
                         ready=url + "/readyz", grace_s=30)
    try:
        with server:
            server.wait_ready(120)
            status, body = send_readme_request(curl_line, url)
            assert_completion(status, body, curl_line)
    finally:
        receiver.stop()


def test_readme_request_works_against_the_gpuscope_stack_server(tmp_path):
    curl_line = readme_first_request()
    options = StackOptions(ports="free", run_dir=tmp_path, components=["server"], health_timeout_s=120)
    with Stack(options, log=lambda line: None) as stack:
        status, body = send_readme_request(curl_line, stack.url("server"))
        assert_completion(status, body, curl_line)


def test_compose_and_stack_configure_the_same_tenants(tmp_path):
    """The two ways of running the stack serve the same tenants (and so the same quick start)."""
    compose = compose_server_argv("127.0.0.1:1", "http://127.0.0.1:2")
    stack = Stack(StackOptions(ports="free", run_dir=tmp_path, components=["server"]), log=lambda line: None)
    stack_argv = stack._process("server").argv

    def tenant_flags(argv: list[str]) -> list[str]:
        return [v for a, v in itertools.pairwise(argv) if a.startswith("--tenants")]

    assert tenant_flags(compose) == tenant_flags(stack_argv)
