"""``gpuscope`` command: dispatches to one module per subcommand.

Each subcommand module exposes ``main(argv: list[str]) -> int`` and owns its
flags, so adding a command touches one line here.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "exporter": ("gpuscope.nvml.main", "NVML node exporter: GPU metrics on /metrics"),
    "serve": ("gpuscope.server.main", "reference inference server (OpenAI-style completions)"),
    "receiver": ("gpuscope.receiver.main", "Alertmanager webhook receiver that logs and lists notifications"),
    "stack": ("gpuscope.ops.stack_command", "start the whole stack from local binaries (no Docker)"),
    "diagnose": ("gpuscope.diagnose.main", "sample this box (or a past window) and say what is wrong"),
    "generate": ("gpuscope.ops.generate", "write every generated file (rules, dashboards, docs, manifests)"),
    "share": ("gpuscope.share.main", "hold processes on one GPU to shares of its time (preload library)"),
    "share-webhook": ("gpuscope.share.webhook", "admission webhook: join annotated pods to gpuscope share"),
    "loadtest": ("gpuscope.loadtest.run", "Locust with the bundle's streaming users against a server"),
    "compare": ("gpuscope.loadtest.compare", "compare server configurations and endpoints under one load"),
    "drill": ("gpuscope.loadtest.fault_drill", "induce each fault under load and time its alert"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:10s} {text}" for name, (_, text) in COMMANDS.items())
    return (f"usage: gpuscope COMMAND [flags]\n\ncommands:\n{rows}\n\n"
            "`gpuscope COMMAND --help` lists a command's flags.\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"gpuscope: unknown command {name!r} (one of: {', '.join(COMMANDS)})\n")
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
