#!/usr/bin/env bash
# CI's bare-wheel cell: build ddpkit's wheel and sdist, install the wheel without extras in a fresh venv, and
# run scripts/bare_install_check.py from a folder outside the checkout (ddpkit --version, ddpkit env, a 2-rank
# ddpkit run, a Trainer SIGKILLed and resumed bit for bit).
#   bash scripts/bare_wheel_check.sh [PYTHON]     # default: python3
# torch: as scripts/setup.sh picks it (the CPU build 2.13.0 without an NVIDIA GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/build-env"
"$work/build-env/bin/python" -m pip install --quiet --disable-pip-version-check build
"$work/build-env/bin/python" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
if grep -iE "deprecat|license.*(table|classifier)" "$work/build.log"; then  # e.g. a license table setuptools refuses from 2027
  echo "bare_wheel_check: the build warned (above)" >&2; exit 1
fi
tar -tzf "$work"/dist/ddpkit-*.tar.gz >"$work/sdist.txt"
if grep -q "tests/test_docs.py" "$work/sdist.txt" && ! grep -q "docs/guarantees.md" "$work/sdist.txt"; then
  echo "bare_wheel_check: the sdist ships tests/test_docs.py without docs/" >&2; exit 1
fi
"$python" -m venv "$work/bare"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_req="torch"          # the default wheel carries CUDA
else
  torch_req="torch==2.13.0"  # the CPU build where pip's index offers it, as scripts/setup.sh picks
fi
"$work/bare/bin/python" -m pip install --quiet --disable-pip-version-check "$torch_req" "$work"/dist/ddpkit-*.whl
"$work/bare/bin/python" -m pip list --format=freeze 2>/dev/null | sed 's/^/  /'
cp scripts/bare_install_check.py "$work/check.py"
mkdir "$work/run"
cd "$work/run"  # outside the checkout: the installed wheel is what runs
"$work/bare/bin/python" "$work/check.py" "$work/run"
