#!/usr/bin/env bash
# The default test suite against any torch (and Python), in a venv of its own:
#   bash scripts/torch_matrix.sh 2.6.0 3.10      # the floor torch on the lowest Python (CI's floor cell)
#   bash scripts/torch_matrix.sh 2.15.0 3.13     # the newest torch on the newest Python it supports
#   bash scripts/torch_matrix.sh 2.13.0          # this machine's Python
# The venv is .venv-torch-VERSION-pyX.Y (made once, reused). Extra pytest arguments go after `--`:
#   bash scripts/torch_matrix.sh 2.6.0 3.10 -- tests/unit -x
#   bash scripts/torch_matrix.sh 2.6.0 3.10 --prepare   # make the venv only (CI does it while other cells run)
# torch comes from pip's index (a CUDA build of several GB where no CPU build is offered, as on PyPI; it runs on
# the CPU too). Only this venv's pip calls lift a machine-wide cap on torch's version (PIP_CONSTRAINT).
# The Python: pythonX.Y on PATH, else pyenv's build of it; where neither is on the machine, the nearest
# Python that is and that the torch version has wheels for, said on the first line of output.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: torch_matrix.sh TORCH_VERSION [PYTHON_VERSION] [-- PYTEST_ARGS]}"
shift
want="${1:-}"
if [ -n "$want" ] && [ "$want" != "--" ] && [ "$want" != "--prepare" ]; then shift; else want=""; fi
prepare=""
if [ "${1:-}" = "--prepare" ]; then prepare=1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi

find_python() {  # pythonX.Y on PATH or in pyenv's versions; empty where neither
  local v="$1" found
  found="$(command -v "python$v" 2>/dev/null || true)"
  if [ -n "$found" ] && "$found" -c "import sys" 2>/dev/null; then echo "$found"; return; fi
  for found in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v"*/bin/"python$v"; do
    if [ -x "$found" ]; then echo "$found"; return; fi
  done
}

python=""
if [ -n "$want" ]; then
  python="$(find_python "$want")"
  if [ -z "$python" ]; then
    # torch 2.15 and later have no wheels for 3.10; every torch from 2.6 has them for 3.11 to 3.13.
    for v in 3.11 3.12 3.13 3.10; do
      python="$(find_python "$v")"
      if [ -n "$python" ]; then
        echo "torch_matrix: Python $want is not on this machine; using Python $v instead" >&2
        break
      fi
    done
  fi
else
  python="$(command -v python3)"
fi
[ -n "$python" ] || { echo "torch_matrix: no Python 3.10-3.13 found on this machine" >&2; exit 2; }
pyv="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
venv=".venv-torch-$version-py$pyv"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pipq() { PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
installed="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [ "$installed" != "$version" ]; then
  pipq "torch==$version"
fi
# ddpkit and what the tests need, keeping that torch (a range it satisfies installs nothing more).
pipq -e ".[dev]" "torch==$version"
"$venv/bin/python" -m compileall -q src/ddpkit  # as scripts/setup.sh does, for this Python
echo "torch_matrix: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') on Python $pyv ($venv)"
[ -n "$prepare" ] && exit 0
exec "$venv/bin/python" -m pytest "$@"
