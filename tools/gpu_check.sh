#!/usr/bin/env bash
# The GPU check: everything attn-ref promises about CuPy and CUDA, in one command.
#
#   tools/gpu_check.sh [OUTDIR]       on a machine with an NVIDIA GPU (default OUTDIR:
#                                     gpu-check-<UTC time>); under 8 minutes
#   tools/gpu_check.sh --fetch-wheels on a machine WITH internet: download into .whl/
#                                     the wheels a GPU machine without internet lacks
#
# Steps (each under its own time limit, each logged; the summary is SUMMARY.txt):
#   1. environment: nvidia-smi, Python, CuPy and its device, torch CUDA. No CuPy or no
#      usable GPU: say so and stop with exit status 3 before anything else runs.
#   2. the whole test matrix with ATTN_REF_REQUIRE_BACKENDS=cupy,numpy,torch,jax,
#      array_api_strict (junit XML);
#   3. `attn-ref verify --backend cupy`: every reference on CuPy, float32 and float64;
#   4. the oracle on torch's CUDA scaled_dot_product_attention forced to its flash and
#      memory-efficient backends, in float16 and bfloat16;
#   5. a short asv pass of the GPU benchmarks, N = 1024 .. 65536 (online softmax, linear
#      attention, one-shot softmax on CuPy; torch CUDA SDPA; matmul rates), then
#      `attn-ref scaling` on its results, and a table of achieved TFLOP/s against the
#      measured matmul rate. The benchmarks synchronise the device before the clock
#      stops (asv_benches/_common.py: Backend.sync).
#
# Offline GPU machines: the packages the project needs beyond a CUDA PyTorch image
# (array-api-compat, array-api-strict, asv, asv-runner, json5, importlib-metadata, and
# cupy-cuda12x where no CuPy is installed) travel as wheels in .whl/ at the repository root, made here
# with --fetch-wheels (Python 3.12, manylinux x86-64). They are installed with
# `pip install --no-index --target` into a private folder put on PYTHONPATH; an
# installed CuPy (e.g. cupy-cuda13x) is kept, never replaced. The project itself is
# used from the checkout through PYTHONPATH, so no build backend is needed.
#
# Exit status: 0 all steps passed, 1 a step failed, 3 no CuPy/GPU (nothing run).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="$ROOT/.whl"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p "$WHEELS"
    # Python 3.12, x86-64, as on the GPU machines this was written for; pip matches
    # manylinux tags exactly, so several are listed.
    plat=()
    for t in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
             manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$t"); done
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d "$WHEELS" \
        "array-api-compat>=1.11" "array-api-strict>=2.3" "asv==0.6.6" "asv-runner>=0.2" \
        json5 importlib-metadata "cupy-cuda12x>=13" || exit 1
    echo "wheels in $WHEELS:"; ls -1 "$WHEELS"
    echo "carry .whl to the GPU machine (add /.whl/ to .git/info/exclude)."
    exit 0
fi

OUT="${1:-$ROOT/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/SUMMARY.txt"
: > "$SUMMARY"
START=$(date +%s)
FAILED=0

say() { echo "$*" | tee -a "$LOG"; }
note() { echo "$*" | tee -a "$LOG" >> "$SUMMARY"; }
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, record the verdict
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS
    say ""; say "=== $name (limit ${limit}s) ==="
    timeout --kill-after=10 "$limit" "$@" > >(tee -a "$LOG" "$OUT/$name.txt") 2>&1
    local rc=$?
    local verdict="ok"
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then verdict="TIMED OUT"; elif [[ $rc -ne 0 ]]; then verdict="FAILED (exit $rc)"; fi
    [[ $verdict == ok ]] || FAILED=1
    note "$(printf '%-12s %-18s %4ds' "$name" "$verdict" $((SECONDS - t0)))"
    return 0
}

say "attn-ref GPU check, $(date -u), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), results in $OUT"

# --------------------------------------------------------------- 1. environment
SITE="${TMPDIR:-/tmp}/attn-ref-gpu-site"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    wheels=()
    for w in "$WHEELS"/*.whl; do
        # Keep an installed CuPy: two CuPy packages in one interpreter break both.
        if [[ $(basename "$w") == cupy* ]] && "$PY" -c "import cupy" 2>/dev/null; then continue; fi
        wheels+=("$w")
    done
    if ((${#wheels[@]})); then
        say "installing ${#wheels[@]} carried wheels into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${wheels[@]}" >> "$LOG" 2>&1 || say "warning: wheel install failed (see log)"
    fi
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# JAX stays on the host (backends.py uses its CPU device); without these it would
# also take 75% of the GPU's memory in every process.
export JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1

{ nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } > "$OUT/nvidia-smi.txt"
"$PY" - > "$OUT/environment.txt" 2>&1 <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
for m in ("numpy", "array_api_compat", "array_api_strict", "torch", "jax", "cupy", "asv", "hypothesis"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:18} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{m:18} MISSING ({type(exc).__name__}: {exc})")
EOF
cat "$OUT/environment.txt" >> "$LOG"

if ! probe=$("$PY" - 2>&1 <<'EOF'
import sys
try:
    import cupy
except Exception as exc:
    print(f"CuPy is not installed ({exc}). Install cupy-cuda12x or cupy-cuda13x to match the "
          "driver, or carry its wheel in .whl/ (tools/gpu_check.sh --fetch-wheels).")
    sys.exit(1)
try:
    n = cupy.cuda.runtime.getDeviceCount()
    props = cupy.cuda.runtime.getDeviceProperties(0)
except Exception as exc:
    print(f"CuPy {cupy.__version__} is installed but CUDA is not usable: {exc}")
    sys.exit(1)
if n < 1:
    print(f"CuPy {cupy.__version__} is installed but there is no CUDA device")
    sys.exit(1)
name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
print(f"CuPy {cupy.__version__}, {n} device(s), device 0: {name}, "
      f"{props['totalGlobalMem'] / 2**30:.0f} GiB")
EOF
); then
    say "gpu_check: STOP - $probe"
    note "environment  STOPPED: $probe"
    say "gpu_check: nothing was run; see $OUT/environment.txt"
    exit 3
fi
note "environment  $probe"
say "$probe"
# Tell the benchmarks what works, so that each asv process does not probe CUDA again.
ATTN_REF_BENCH_GPU=cupy
if "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    ATTN_REF_BENCH_GPU=cupy,torch-cuda
else
    note "environment  torch has no CUDA here: the SDPA oracle and benchmarks will fail"
fi
export ATTN_REF_BENCH_GPU

# ----------------------------------------------------------------- 2. test matrix
export ATTN_REF_REQUIRE_BACKENDS=cupy,numpy,torch,jax,array_api_strict
xdist=()
if "$PY" -c "import xdist" 2>/dev/null; then xdist=(-n 8); fi
step tests 170 "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
    --junitxml="$OUT/pytest.xml" -o junit_family=xunit2 tests
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -n 25 >> "$SUMMARY"
"$PY" - "$OUT/pytest.xml" >> "$SUMMARY" 2>/dev/null <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
cupy = [c for c in root.iter("testcase") if "[cupy" in c.get("name", "") or "-cupy" in c.get("name", "")]
bad = [c for c in cupy if c.find("failure") is not None or c.find("error") is not None]
skip = [c for c in cupy if c.find("skipped") is not None]
print(f"tests on cupy: {len(cupy) - len(bad) - len(skip)} passed, {len(bad)} failed, {len(skip)} skipped")
EOF

# ------------------------------------------------------- 3. references on CuPy
step verify-cupy 70 "$PY" -m conformance.cli verify --backend cupy --json "$OUT/verify_cupy.json"
tail -n 3 "$OUT/verify-cupy.txt" >> "$SUMMARY"

# ------------------------------------------ 4. the oracle on torch CUDA SDPA
step oracle-sdpa 70 "$PY" - "$OUT" <<'EOF'
"""torch CUDA SDPA, forced to one backend, through conformance.verify in half precision."""
import json, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from conformance import verify

out_dir = sys.argv[1]


def flash(q, k, v, *, is_causal=False, scale=None):
    # The flash backend takes no mask: the signature says so, and the oracle skips
    # the masked cases (n/a) instead of counting them.
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def efficient(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale)


reports, ok = [], True
for name, kernel in (("flash", flash), ("efficient", efficient)):
    rep = verify(kernel, "softmax", backend="torch", device="cuda",
                 dtypes=("float16", "bfloat16"), suite="standard", progress=False)
    print(f"--- torch CUDA SDPA, {name} backend: {rep.summary()}")
    print(rep.table())
    unsupported = [r for r in rep.failures if "No available kernel" in (r.diagnosis or "")]
    if unsupported:
        print(f"({len(unsupported)} of the failures are shapes the forced {name} backend refuses: "
              "'No available kernel')")
    reports.append(rep.to_dict())
    ok = ok and rep.passed
with open(f"{out_dir}/oracle_sdpa.json", "w") as fh:
    json.dump(reports, fh, indent=1)
sys.exit(0 if ok else 1)
EOF
grep -E "^--- |refuses" "$OUT/oracle-sdpa.txt" >> "$SUMMARY"

# ------------------------------------------------------- 5. GPU benchmarks (asv)
export ATTN_REF_BENCH_BACKENDS=cupy ATTN_REF_BENCH_MIN_N=1024 ATTN_REF_BENCH_MAX_N=65536
ASV=("$PY" -m asv)
ASV_FILTER=(
    -b "Attention\.time_forward\('(online_softmax|linear|softmax)', 'cupy'"
    -b "TorchSDPA\.time_forward\('cuda-(float32|flash-bfloat16)'"
    -b "Matmul" -b "FlopRate"
)
# asv records results against a commit; a copy of the tree without its .git (as the
# device machines get) becomes a throwaway one-commit repository first.
if ! git rev-parse HEAD > /dev/null 2>&1; then
    say "no git repository here: making a throwaway one for asv"
    { git init -q -b main . 2>/dev/null || git init -q .; } && git add -A . && git -c user.name=gpu-check -c user.email=gpu-check@localhost \
        commit -q -m "gpu_check snapshot" >> "$LOG" 2>&1
fi
"${ASV[@]}" machine --yes --machine gpu-check >> "$LOG" 2>&1
step asv 140 "${ASV[@]}" run -E "existing:$(command -v "$PY")" --machine gpu-check \
    --set-commit-hash "$(git rev-parse HEAD)" --show-stderr "${ASV_FILTER[@]}"
results=$(ls -t .asv/results/gpu-check/*.json 2>/dev/null | grep -v machine.json | head -n 1)
if [[ -n "$results" ]]; then
    cp "$results" "$OUT/asv_results.json"
    step scaling 20 "$PY" -m conformance.scaling --results "$OUT/asv_results.json" \
        --plot "$OUT/scaling_gpu.png" --markdown "$OUT/scaling_gpu.md"
    "$PY" - "$OUT/asv_results.json" > "$OUT/tflops.txt" 2>&1 <<'EOF'
"""Time at N = 16384 and 65536, CuPy references next to torch CUDA SDPA, with TFLOP/s."""
import sys
from conformance.scaling import load_results

res = load_results(sys.argv[1])
flops = lambda n, name: 8 * 4 * n * n * 64 if name != "linear" else 8 * 4 * n * 64 * 64
rate = {k: v / 1e3 for k, v in res.matmul.items()}  # TFLOP/s
print("measured matmul rate (TFLOP/s): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(rate.items())))
print(f"{'N':>6}  {'function':<16} {'backend':<28} {'time':>10} {'TFLOP/s':>8} {'of matmul':>9}")
for n in (16384, 65536):
    for s in sorted(res.series, key=lambda s: (s.name, s.backend)):
        if s.kind != "time" or n not in s.points:
            continue
        if s.name not in ("online_softmax", "linear", "softmax", "torch_sdpa"):
            continue
        t = s.points[n]
        tf = flops(n, s.name) / t / 1e12
        ref = rate.get("torch-cuda-bfloat16" if "bfloat16" in s.backend
                       else "torch-cuda-float32" if s.backend.startswith("torch") else "cupy")
        frac = f"{tf / ref:.1%}" if ref else "-"
        print(f"{n:>6}  {s.name:<16} {s.backend:<28} {t * 1e3:>8.2f}ms {tf:>8.2f} {frac:>9}")
EOF
    cat "$OUT/tflops.txt" | tee -a "$LOG" >> "$SUMMARY"
else
    note "asv          no results file written"
    FAILED=1
fi

note "total        $(( $(date +%s) - START ))s; files in $OUT"
say ""; cat "$SUMMARY"
exit $FAILED
