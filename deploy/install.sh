#!/usr/bin/env bash
# Installs what adstream needs on Debian/Ubuntu: the service packages (as root, when missing)
# and a virtual environment with the pinned Python dependencies. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# the first of python3.11…3.13 found (pyproject's requires-python), or $PYTHON
supported() { "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null; }
if [ -z "${PYTHON:-}" ]; then
  for candidate in python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && supported "$candidate"; then PYTHON=$candidate; break; fi
  done
fi
if [ -z "${PYTHON:-}" ] || ! supported "$PYTHON"; then
  echo "adstream needs Python 3.11, 3.12 or 3.13 (found: ${PYTHON:-none}; set PYTHON=/path/to/python3.x)" >&2
  exit 1
fi

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
[ -x /usr/sbin/clickhouse-server ] || command -v clickhouse-server >/dev/null 2>&1 || need_apt+=(clickhouse-server)
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || need_apt+=(chromium)
command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)  # the HTTP load tool of benchmarks/serve.py
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing Debian packages: ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "missing Debian packages: ${need_apt[*]} (run: sudo apt-get install ${need_apt[*]})" >&2
    exit 1
  fi
fi

stamp="$VENV/.adstream-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt constraints.txt ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first and alone: the CPU build where pip finds one (a local wheel here; elsewhere
# TORCH_INDEX=https://download.pytorch.org/whl/cpu, or …/cu128 for CUDA); asking for it inside a
# larger resolve may pull PyPI's CUDA build. Then the project with every extra ([dev]: bench,
# chdb, test, lint), what make test and make lint run.
"$VENV/bin/pip" install -q "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"$VENV/bin/pip" install -q -c constraints.txt -e ".[dev]"
touch "$stamp"
