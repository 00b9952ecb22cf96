#!/usr/bin/env bash
# The GPU tier: the tests marked `gpu` and the GPU figures (bench, memory, snapshot stall, step time by
# precision), in under 9 minutes on one GPU (more GPUs: more ranks, and the tests that need two run too).
#
#   bash scripts/gpu_check.sh            # results in $OUT, else ./gpu-check-out
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# Needs a python whose torch has CUDA and sees a GPU, with pytest (pytest-timeout; pytest-xdist is used when
# there). Installs nothing and needs no network: ddpkit runs from src/ (PYTHONPATH). Every part has its own
# time limit, so a hang cannot eat the rest; the script goes on after a failure and exits non-zero at the end
# if any part failed. Without a CUDA GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!
# The log is whole before the script returns: tee may still be writing when the last line is echoed.
trap 'exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null' EXIT
START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-555}  # the whole run, in seconds (the machine's limit is 10 minutes a command)
FIGURES="$OUT/figures.md"
failed=()

# -- a python with CUDA ------------------------------------------------------------------------------------
has_cuda() {
  timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.device_count() > 0 else 1)' \
    >/dev/null 2>&1
}
PY=""
for candidate in "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3 "$ROOT/.venv/bin/python" python; do
  [ -n "$candidate" ] || continue
  command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
  if has_cuda "$candidate"; then PY="$(command -v "$candidate" || echo "$candidate")"; break; fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: skipped: no CUDA (no python here has a torch that sees a CUDA GPU; tried \$PYTHON, python3," \
       "/opt/torch/.venv/bin/python3, .venv/bin/python, python)"
  exit 0
fi
# ddpkit from this checkout, importable by every process the tests and tools start (ranks, loader workers).
# Not a virtual environment: one made from this python (itself often a venv) would not see its torch.
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

left() { echo $((BUDGET - (SECONDS - START))); }
# part NAME LIMIT_S COMMAND...: run it with a time limit (cut to what is left of the budget), log its status.
part() {
  local name="$1" limit="$2"; shift 2
  local remaining; remaining=$(( $(left) - 5 ))
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo
  echo "=== $name (limit ${limit}s, $(( SECONDS - START ))s elapsed) ==="
  if [ "$limit" -lt 10 ]; then
    echo "--- $name: NOT RUN: out of time"
    failed+=("$name (not run: out of time)")
    return
  fi
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ $rc -eq 0 ]; then
    echo "--- $name: ok in $(( SECONDS - t0 ))s"
  else
    [ $rc -eq 124 ] && echo "--- $name: TIMED OUT after ${limit}s" || echo "--- $name: FAILED (exit $rc)"
    failed+=("$name (exit $rc)")
  fi
}

echo "# gpu_check $(date -u '+%Y-%m-%d %H:%M:%S') UTC on $(hostname), $(nproc) cores; python: $PY"
echo "=== nvidia-smi ==="
timeout 60 nvidia-smi || echo "(nvidia-smi failed)"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
"$PY" - <<'EOF'
import platform, torch
import torch.distributed as dist
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA (build) {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"nccl available {dist.is_nccl_available()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}")
for name in ("pytest", "pytest_timeout", "xdist", "numpy", "sklearn", "matplotlib"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '(no version)')}")
    except ImportError:
        print(f"{name} not installed")
EOF
{
  echo "# GPU figures ($(date -u '+%Y-%m-%d %H:%M') UTC, $GPUS GPU(s), $(hostname))"
  echo
  echo '```'
  timeout 60 nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  echo '```'
} > "$FIGURES"

# -- ddpkit env: the GPU fields and both live checks -------------------------------------------------------
part "ddpkit env" 60 bash -o pipefail -c "'$PY' -m ddpkit.cli env | tee '$OUT/env.txt'"
{ echo; echo "## ddpkit env"; echo '```'; cat "$OUT/env.txt" 2>/dev/null; echo '```'; } >> "$FIGURES"
rm -f "$OUT/env.txt"

# -- the tests ---------------------------------------------------------------------------------------------
# The tier's files only: a test module elsewhere may need a package this machine lacks (optuna), and an
# import error at collection would stop the whole run.
xdist=()
"$PY" -c 'import xdist' >/dev/null 2>&1 && xdist=(-n 4)  # four at once: one GPU holds them easily
part "pytest -m gpu" 290 "$PY" -m pytest -m gpu tests/jobs/test_gpu_jobs.py tests/jobs/test_gpu_training.py -rA \
  -p no:cacheprovider "${xdist[@]}" --junitxml="$OUT/junit-gpu.xml"

# -- the figures -------------------------------------------------------------------------------------------
if [ "$GPUS" -ge 2 ]; then
  part "ddpkit bench (DDP over $GPUS GPUs, one GPU, DataParallel; the predictor on nccl)" 170 bash -o pipefail -c \
    "'$PY' -m ddpkit.cli bench --nproc $GPUS --rounds 2 --steps 30 --warmup 5 --no-knobs --out '$OUT/bench' \
     | tee '$OUT/bench.txt'"
else
  # `ddpkit bench` compares world sizes from 2 up, which nccl cannot place on one GPU: here the DDP step on
  # one GPU over nccl (the bench's own measurement, parts and all) and the one-GPU run without DDP.
  one_gpu="$(mktemp --suffix=.py)"
  cat > "$one_gpu" <<'EOF'
import functools, json, sys
from types import SimpleNamespace
from ddpkit.distributed._spawn import spawn
from ddpkit.tools._bench import _start_method, compare_data_parallel
from ddpkit.tools._measure import Knobs, measure_steps


def main():  # spawned ranks import this file again: nothing may run at import

    rounds = [spawn(functools.partial(measure_steps, None, knobs, 40, 10, True, True), 1, start_method=_start_method())[0]
              for _ in range(2) for knobs in (Knobs(), Knobs(pin_memory=True))]
    best = {pin: min((r for r, k in zip(rounds, [False, True] * 2) if k == pin), key=lambda r: r["medians"]["step"])
            for pin in (False, True)}
    dp = compare_data_parallel(SimpleNamespace(script=None, steps=40, warmup=10))
    ms = lambda s: f"{s * 1e3:.3f}"
    print(f"workload: the DDP tutorials' CNN on sklearn digits, batch {best[False]['batch_size']} per rank; "
          f"2 rounds x 40 steps after 10, the fastest round")
    print(f"{'run':36s} {'data':>7s} {'forward':>8s} {'backward':>9s} {'exposed AR':>10s} {'AR span':>8s} "
          f"{'optimizer':>9s} {'step ms':>8s} {'samples/s':>10s}")
    for pin in (False, True):
        label = f"DDP, 1 rank, {best[pin]['backend']}, {best[pin]['device']}" + (", pin_memory" if pin else "")
        p = best[pin]["medians"]
        exposed = max(0.0, p["backward"] - p["backward_no_sync"])
        print(f"{label:36s} {ms(p['data']):>7s} {ms(p['forward']):>8s} {ms(p['backward']):>9s} {ms(exposed):>10s} "
              f"{ms(p['allreduce_span']):>8s} {ms(p['optimizer']):>9s} {ms(p['step']):>8s} "
              f"{best[pin]['batch_size'] / p['step']:>10.0f}")
    single = dp["single_gpu"]
    print(f"{'one GPU, no DDP':36s} {'':>7s} {'':>8s} {'':>9s} {'':>10s} {'':>8s} {'':>9s} {ms(single['step']):>8s} "
          f"{single['samples'] / single['step']:>10.0f}")
    d = dp["data_parallel"]
    print(f"{'DataParallel over 1 GPU (no split)':36s} {'':>7s} {'':>8s} {'':>9s} {'':>10s} {'':>8s} {'':>9s} "
          f"{ms(d['step']):>8s} {d['samples'] / d['step']:>10.0f}")
    print("predictor's error on nccl: needs 2 GPUs (it predicts an n-rank step from the 1-rank step and the "
          "n-rank all-reduce, and measures the n-rank step to compare)")
    json.dump({"ddp_one_rank": best[False], "ddp_one_rank_pinned": best[True], "data_parallel": dp},
              open(sys.argv[1], "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
EOF
  part "bench on one GPU (DDP over nccl at 1 rank, one GPU without DDP)" 100 bash -o pipefail -c \
    "'$PY' '$one_gpu' '$OUT/bench_one_gpu.json' | tee '$OUT/bench.txt'"
  rm -f "$one_gpu"
fi
{ echo; echo "## ddpkit bench"; echo '```'; cat "$OUT/bench.txt" 2>/dev/null; echo '```'; } >> "$FIGURES"
rm -f "$OUT/bench.txt"

part "bench/memory.py (ddp, zero, fsdp; $GPUS rank(s))" 100 bash -o pipefail -c \
  "'$PY' bench/memory.py --rounds 2 | tee '$OUT/memory.txt'"
{ echo; echo "## bench/memory.py"; echo '```'; cat "$OUT/memory.txt" 2>/dev/null; echo '```'; } >> "$FIGURES"
rm -f "$OUT/memory.txt"

part "bench/snapshot_stall.py ($GPUS rank(s))" 100 bash -o pipefail -c \
  "'$PY' bench/snapshot_stall.py | tee '$OUT/stall.txt'"
{ echo; echo "## bench/snapshot_stall.py"; echo '```'; cat "$OUT/stall.txt" 2>/dev/null; echo '```'; } >> "$FIGURES"
rm -f "$OUT/stall.txt"

part "bench/precision.py (fp32, tf32, bf16, fp16 step time)" 60 bash -o pipefail -c \
  "'$PY' bench/precision.py | tee '$OUT/precision.txt'"
{ echo; echo "## bench/precision.py"; echo '```'; cat "$OUT/precision.txt" 2>/dev/null; echo '```'; } >> "$FIGURES"
rm -f "$OUT/precision.txt"

# Copies in memory from the GPU and a lost node healed from them over nccl (that one needs 2 GPUs), and the
# copy's figures: last, so that they take what the parts above leave of the budget.
part "pytest -m gpu: copies in memory from the GPU, a lost node healed in place" 150 "$PY" -m pytest -m gpu \
  tests/jobs/snapshot/test_replicas_gpu.py -rA -s -p no:cacheprovider --junitxml="$OUT/junit-replicas.xml"
part "bench/replicas.py --part device (a copy from the GPU: pinned, a side stream)" 60 bash -o pipefail -c \
  "'$PY' bench/replicas.py --part device | tee '$OUT/replicas.txt'"
{ echo; echo "## bench/replicas.py --part device"; echo '```'; cat "$OUT/replicas.txt" 2>/dev/null; echo '```'; } \
  >> "$FIGURES"
rm -f "$OUT/replicas.txt"

echo
echo "=== gpu_check: $(( SECONDS - START ))s in all; results in $OUT ==="
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}" | tee -a "$FIGURES"
  exit 1
fi
echo "all parts passed" | tee -a "$FIGURES"
