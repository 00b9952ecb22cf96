#!/usr/bin/env bash
# Create .venv with ddpkit (editable) and a torch build that fits this machine.
#   bash scripts/setup.sh            # ddpkit + what the examples need
#   bash scripts/setup.sh dev        # + what the tests need
#   bash scripts/setup.sh dev,bench  # + Accelerate and Lightning, the peers of bench/peers.py
#   VENV=.venv-ray bash scripts/setup.sh ray,examples   # Ray Train, in a venv of its own (see .ci/run)
# Without an NVIDIA GPU it asks for the CPU build pinned below; an unpinned `torch` would pull several GB of
# CUDA libraries that a CPU-only machine cannot use. Re-running it installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-examples}"
venv="${VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_req="torch>=2.6"     # the default wheel carries CUDA
else
  torch_req="torch==2.13.0"  # the CPU build (+cpu) where pip's index offers it, as on our CI machines
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$torch_req" -e ".[$extras]"
# ddpkit's bytecode, written once: an editable install leaves it to each import, and where
# PYTHONDONTWRITEBYTECODE is set (as in many containers and on our CI machines) every process that imports
# ddpkit (each rank, each test's job) would compile its sources again (~0.4 s a process on 2 cores).
"$venv/bin/python" -m compileall -q src/ddpkit
