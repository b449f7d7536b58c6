#!/usr/bin/env bash
# polylin's GPU check, in one go (docs/gpu.md explains it):
#   1. records the machine (nvidia-smi, versions, TF32-related settings)          -> env.txt
#   2. installs what the machine lacks from carried wheels in .whl/, offline, into a
#      --target folder, and makes polylin importable from the working tree
#   3. runs the device correctness tests on torch:cuda, CuPy and jax:cuda, and the
#      converted transformers models on the GPU                                    -> tests.log
#   4. runs the test suite once per GPU backend (its tests)                        -> tests.log (appended)
#   5. runs the GPU benchmark of plain linear attention (only if GPU_CHECK_STEPS
#      names `bench`: the family benchmark covers its ratios)                      -> bench.log, bench-gpu.json, bench-gpu.png
#   6. runs the GPU benchmark of the recurrence family against fla's kernels       -> bench.log (appended), bench-family.json
#   7. profiles the family's ops: kernels, chunk sizes, CUDA graphs, decoding      -> bench.log (appended), bench-profile.json
#   8. prints a short summary                                                      -> summary.txt
# Everything goes to $OUT (default ./gpu-check-out), at most 8 files (the lending machine returns no more). Each step has a timeout,
# a share of GPU_CHECK_TOTAL_S (default 470 s, inside the 8 minutes asked for; install 6%,
# device tests 25%, suite 30%, the family benchmark all but 12%, the profile what is left), so
# the script always ends and always leaves its logs. Exit status: 0 when every step run passed.
# GPU_CHECK_STEPS (default install,device,suite,family,profile) names the steps to run;
# GPU_CHECK_SUITE (default: every test file) the test files of step 4.
#
# On the GPU machine (repository root):   bash backends/gpu-check.sh
# Dry run of the script itself on a CPU:  GPU_CHECK_MODE=cpu PYTHON=.venv/bin/python bash backends/gpu-check.sh
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
MODE=${GPU_CHECK_MODE:-gpu}            # gpu | cpu (dry run: same steps, CPU backends, tiny sizes)
TOTAL=${GPU_CHECK_TOTAL_S:-470}
WANTED=${GPU_CHECK_STEPS:-install,device,suite,family,profile}
want() { [[ ",$WANTED," == *",$1,"* ]]; }
T0=$(date +%s)

elapsed() { echo $(($(date +%s) - T0)); }
say() { echo "[gpu-check $(elapsed)s] $*"; }
# budget WANT RESERVE (percent of TOTAL): WANT% of the total, or less so that RESERVE% stays for
# the later steps; at least 5 s.
budget() {
    local want=$((TOTAL * $1 / 100)) left=$((TOTAL - $(elapsed) - TOTAL * $2 / 100))
    local b=$((want < left ? want : left))
    echo $((b > 5 ? b : 5))
}
declare -A RC
STEPS=()
record() { RC[$1]=$2; STEPS+=("$1"); say "$1: exit $2"; }

if [ "$MODE" = cpu ]; then
    BACKENDS=torch,numpy
    BENCH_ARGS=(--device cpu --seq-lens 256 128 --dims 16 --batch 1 --heads 2 --repeats 2
                --seed-loop-len 16 --matmul-size 128)
    FAMILY_ARGS=(--device cpu --seq-lens 128 --dims 16 --batch 1 --heads 2 --repeats 2
                 --decode-batches 1 --decode-tokens 4)
    SUITE=(tests/test_gpu_device.py tests/test_benchmarks_gpu.py tests/test_gpu_family_benchmark.py)
    PROFILE_ARGS=(--device cpu --T 128 --d 16 --batch 1 --heads 2 --chunks 32 64 --repeats 2)
else
    BACKENDS=${GPU_CHECK_BACKENDS:-torch:cuda,cupy,jax:cuda}
    BENCH_ARGS=(--device cuda)
    # torch.compile of the one op Qwen3-Next runs (compiling all five would take the budget).
    FAMILY_ARGS=(--device cuda --compile-ops chunk_gated_delta_rule)
    # The benchmark's CPU smoke test adds nothing here: the real benchmark runs in step 5.
    SUITE=(tests/ --ignore=tests/test_gpu_device.py --ignore=tests/test_benchmarks_gpu.py
           --ignore=tests/test_gpu_family_benchmark.py --ignore=tests/test_gpu_transformers.py)
    if [ -n "${GPU_CHECK_SUITE:-}" ]; then read -r -a SUITE <<<"$GPU_CHECK_SUITE"; fi
    PROFILE_ARGS=(--device cuda)
fi

# ---- 1. the machine -------------------------------------------------------------------------
say "mode $MODE, python $PY, output $OUT"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "TF32-related environment as found (the script then unsets the overrides, CUPY_TF32=0):"
    for v in TORCH_ALLOW_TF32_CUBLAS_OVERRIDE NVIDIA_TF32_OVERRIDE CUPY_TF32; do
        echo "  $v=${!v-<unset>}"
    done
    timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    timeout 60 "$PY" - <<'EOF' 2>&1
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("numpy", "torch", "cupy", "triton", "fla", "array_api_compat", "array_api_strict",
             "hypothesis", "matplotlib", "pytest", "jax"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')} ({getattr(mod, '__file__', '?')})")
    except Exception as exc:
        print(f"{name}: not importable before the wheels ({type(exc).__name__})")
try:
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"torch sees {p.name}, {p.total_memory / 2**30:.0f} GiB, cuda {torch.version.cuda}")
    print("float32 matmul precision:", torch.get_float32_matmul_precision(),
          "allow_tf32:", torch.backends.cuda.matmul.allow_tf32)
except Exception as exc:
    print("torch probe failed:", exc)
EOF
} >"$OUT/env.txt" 2>&1
say "machine recorded in env.txt"

# TF32 is left to the libraries' defaults (torch: off for float32 matmuls; CuPy: off); the test
# session pins torch to "highest" (tests/conftest.py). Overrides in the image would hide that.
unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE NVIDIA_TF32_OVERRIDE
export CUPY_TF32=0
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# JAX is in the image: unless jax:cuda is tested, keep it off the GPU; never let it grab 75% of
# the GPU memory up front, which would starve the libraries under test.
case ",$BACKENDS," in *,jax:cuda,*) ;; *) export JAX_PLATFORMS=cpu ;; esac
export XLA_PYTHON_CLIENT_PREALLOCATE=false

# ---- 2. offline install ---------------------------------------------------------------------
rc=0
if want install && compgen -G ".whl/*.whl" >/dev/null; then
    timeout "$(budget 6 85)" "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >>"$OUT/env.txt" 2>&1 || rc=$?
else
    echo "no .whl/*.whl carried (or install not in GPU_CHECK_STEPS): using what is installed" >>"$OUT/env.txt"
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! timeout 60 "$PY" -c "import polylin, array_api_compat, array_api_strict, array_api_extra, hypothesis
print('polylin', polylin.__version__, 'from', polylin.__file__)" >>"$OUT/env.txt" 2>&1; then
    [ "$rc" = 0 ] && rc=1
fi
record install "$rc"
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rfEs)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST+=(--timeout 90)  # one hung test must not eat the whole step
fi
: >"$OUT/tests.log"
: >"$OUT/bench.log"

# ---- 3. device correctness tests ------------------------------------------------------------
if want device; then
    say "device tests (POLYLIN_BACKENDS=$BACKENDS)"
    POLYLIN_BACKENDS=$BACKENDS timeout -k 10 "$(budget 25 55)" "${PYTEST[@]}" \
        tests/test_gpu_device.py tests/test_gpu_transformers.py >>"$OUT/tests.log" 2>&1
    record device-tests $?
fi

# ---- 4. the test suite ----------------------------------------------------------------------
# Not -x: one GPU run should report every failure it can, so stop only after many. One run per
# backend, each with its share of the step's time, so that each leaves its own result line
# even when a later one runs out of time; on the GPU only the tests of that backend are
# selected (their ids name it), in parallel where pytest-xdist is there (a carried wheel).
IFS=, read -r -a SUITE_BACKENDS <<<"$BACKENDS"
if want suite; then
    say "test suite (POLYLIN_BACKENDS=$BACKENDS)"
    echo "==== the test suite ====" >>"$OUT/tests.log"
    XDIST=()
    if [ "$MODE" = gpu ] && "$PY" -c "import xdist" 2>/dev/null; then
        XDIST=(-n "${GPU_CHECK_WORKERS:-10}")
    fi
    suite_rc=0
    suite_total=$(budget 30 30)
    for i in "${!SUITE_BACKENDS[@]}"; do
        b=${SUITE_BACKENDS[$i]}
        share=$(( (suite_total - (${SECONDS_USED:-0})) / (${#SUITE_BACKENDS[@]} - i) ))
        [ "$share" -gt 5 ] || share=5
        start=$(date +%s)
        SELECT=()
        [ "$MODE" = gpu ] && SELECT=(-m "not slow" -k "$b")
        echo "==== backend $b ($share s) ====" >>"$OUT/tests.log"
        POLYLIN_BACKENDS=$b timeout -k 10 "$share" "${PYTEST[@]}" "${XDIST[@]}" --maxfail=25 \
            "${SELECT[@]}" "${SUITE[@]}" \
            >>"$OUT/tests.log" 2>&1 || suite_rc=$?
        SECONDS_USED=$(( ${SECONDS_USED:-0} + $(date +%s) - start ))
    done
    record test-suite $suite_rc
fi

# ---- 5. the plain benchmark (opt-in) --------------------------------------------------------
# The benchmark stops starting measurements at its own budget and writes JSON after every
# cell; the hard timeout leaves it 45 s to finish the measurement under way, plot and summarize.
if want bench; then
    hard=$(budget 17 40)
    soft=$((hard > 60 ? hard - 45 : hard / 2))
    say "benchmark: --time-budget $soft s, hard limit $hard s"
    timeout -k 10 "$hard" "$PY" benchmarks/run.py gpu "${BENCH_ARGS[@]}" --out "$OUT" \
        --time-budget "$soft" >>"$OUT/bench.log" 2>&1
    record benchmark $?
fi

# ---- 6. the family benchmark ----------------------------------------------------------------
# It stops starting cells at its budget and writes JSON after each.
if want family; then
    if want profile; then hard=$(budget 100 12); else hard=$(budget 100 3); fi
    soft=$((hard > 60 ? hard - 45 : hard / 2))
    say "family benchmark: --time-budget $soft s, hard limit $hard s"
    echo "==== benchmarks/gpu_family.py ====" >>"$OUT/bench.log"
    timeout -k 10 "$hard" "$PY" benchmarks/gpu_family.py "${FAMILY_ARGS[@]}" \
        --json "$OUT/bench-family.json" --time-budget "$soft" >>"$OUT/bench.log" 2>&1
    record family-benchmark $?
fi

# ---- 7. the profile -------------------------------------------------------------------------
if want profile; then
    hard=$(budget 100 3)
    soft=$((hard > 40 ? hard - 30 : hard / 2))
    say "profile: --time-budget $soft s, hard limit $hard s"
    echo "==== benchmarks/gpu_profile.py ====" >>"$OUT/bench.log"
    timeout -k 10 "$hard" "$PY" benchmarks/gpu_profile.py "${PROFILE_ARGS[@]}" \
        --json "$OUT/bench-profile.json" --time-budget "$soft" >>"$OUT/bench.log" 2>&1
    record profile $?
fi

# ---- 8. summary -----------------------------------------------------------------------------
{
    echo "polylin GPU check ($MODE) in $(elapsed) s; output in $OUT"
    for s in "${STEPS[@]}"; do echo "  $s: exit ${RC[$s]}"; done
    # tests.log: the device tests, then (after its header) the suite; one result line each.
    line=$(awk '/^==== the test suite ====$/ {exit} {print}' "$OUT/tests.log" \
        | grep -E '[0-9]+ (passed|failed|errors?|skipped)' | tail -1)
    echo "device tests: ${line:-no pytest result line (exit ${RC[device-tests]}; 124 = timed out)}"
    for b in "${SUITE_BACKENDS[@]}"; do
        line=$(awk -v h="==== backend $b " 'index($0, "==== backend ") == 1 {p = index($0, h) == 1; next} p' \
            "$OUT/tests.log" | grep -E '[0-9]+ (passed|failed|errors?|skipped)' | tail -1)
        echo "suite on $b: ${line:-no pytest result line (124 = timed out)}"
    done
    grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" | head -40
    if [ -s "$OUT/bench-gpu.json" ]; then
        timeout 30 "$PY" benchmarks/run.py gpu --summary-of "$OUT/bench-gpu.json" 2>&1
    elif want bench; then
        echo "benchmark: no bench-gpu.json; last lines of bench.log:"
        tail -20 "$OUT/bench.log"
    fi
    if [ -s "$OUT/bench-family.json" ]; then
        timeout 30 "$PY" benchmarks/gpu_family.py --summary-of "$OUT/bench-family.json" 2>&1
    else
        echo "family benchmark: no bench-family.json"
    fi
    if [ -s "$OUT/bench-profile.json" ]; then
        timeout 30 "$PY" benchmarks/gpu_profile.py --summary-of "$OUT/bench-profile.json" 2>&1
    fi
} >"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
status=0
for s in "${STEPS[@]}"; do [ "${RC[$s]}" = 0 ] || status=1; done
say "done, exit $status"
exit $status
