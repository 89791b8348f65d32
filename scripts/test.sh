#!/usr/bin/env bash
# The one test command (README's quickstart; .ci/run calls it with GPUSCOPE_STRICT=1).
# On a fresh Debian machine it installs everything the tests need, then runs every test:
#   - Debian packages (when run as root): Prometheus + promtool, Alertmanager + amtool,
#     node_exporter, docker-compose (for `config` validation), Node.js + npm (LogQL grammar),
#     VictoriaMetrics + vmagent + vmalert (the fleet profile's test), openssl (the share webhook's
#     test certificate);
#   - a virtual environment in .venv with torch's CPU build (installed first, by exact pin, from a
#     local wheel where the machine has one, else from torch's CPU index, so pip does not fetch a
#     multi-GB CUDA build) and gpuscope with its extras;
#   - npm packages for the LogQL syntax check;
# then ruff, and pytest in two worker processes (GPU tests skip without a GPU; distro-binary tests
# fail instead of skipping when GPUSCOPE_STRICT=1).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  for pair in prometheus:prometheus promtool:prometheus prometheus-alertmanager:prometheus-alertmanager \
              amtool:prometheus-alertmanager prometheus-node-exporter:prometheus-node-exporter \
              docker-compose:docker-compose node:nodejs npm:npm victoria-metrics:victoria-metrics \
              vmagent:victoria-metrics vmalert:victoria-metrics openssl:openssl; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair##*:}")
  done
  # A C compiler and Python's headers build the timer's C hot path (optional at install time,
  # but the tests run both hot paths and, with GPUSCOPE_STRICT=1, fail if the C one is missing).
  command -v gcc >/dev/null || need+=(gcc)
  "${PYTHON:-python3}" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
    2>/dev/null || need+=(python3-dev)
  if [ ${#need[@]} -gt 0 ]; then
    step "apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  step "virtual environment .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
TORCH=torch==2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  # By exact pin, CPU build, before anything that depends on it: a plain `torch` from PyPI is the
  # multi-GB CUDA build. A wheel already on this machine's disk (pip's --find-links) is used when there
  # is one; otherwise torch's own CPU index, as README's no-Docker path says.
  if "$VPY" -m pip install -q --no-index --no-deps "$TORCH" 2>/dev/null; then
    step "$TORCH from this machine's wheels, then its dependencies"
    "$VPY" -m pip install -q "$TORCH"
  else
    step "$TORCH (CPU build) from $TORCH_CPU_INDEX"
    "$VPY" -m pip install -q "$TORCH" --index-url "$TORCH_CPU_INDEX"
  fi
fi
step "gpuscope and its extras"
"$VPY" -m pip install -q -e ".[server,loadtest,dashboards,dev,hf,tracing,cupti]"

if [ -f tools/logql/package.json ] && command -v npm >/dev/null; then
  step "npm packages for the LogQL grammar check"
  (cd tools/logql && npm ci --silent --no-audit --no-fund)
fi

step "ruff"
.venv/bin/ruff check .

step "pytest"
# Two worker processes (pytest-xdist): most long tests wait on the services they start, so the other
# worker runs tests meanwhile. A file's tests stay in one worker (its module fixtures start once), and
# files with slow or distro-binary tests go first (tests/conftest.py). A later `-n 0` runs in one process.
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
