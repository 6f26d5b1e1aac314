#!/usr/bin/env bash
# A whole device lease in one call: the GPU checks (run_gpu_checks.sh) and the accuracy fixture's
# training (train_fixture.sh) side by side on the one GPU.
#
# The lease is 15 minutes with the machine's start, so one full call is all there is. The training
# needs the GPU, not the host; the checks' first stages (the csrc/ build, the GPU tests) need the
# host and correctness, not a quiet GPU. So the fixture trains (LEASE_TRAIN_S, default 220 s) while
# the checks build and test; their timed stages wait for the training's end (GPU_CHECKS_WAIT_FOR),
# so no timing is taken on a shared GPU.
#
# Device tool:
#   run(command="bash benchmarks/device/lease.sh", carry=[".whl-gpu", ".fixture-corpus"], timeout_s=595, kind="nvidia-h200")
# (arguments go to run_gpu_checks.sh: a second, shorter call repeats what failed with --only STAGES)
# .whl-gpu: transformers 5.19.0 (the CPU venv's; the image's 5.17 has another GlmMoeDsa), installed
# here into /tmp/site; .fixture-corpus: CPython 3.11.7's pydoc topics (train_fixture.sh's header).
#
# $OUT (5 of the tool's 8 files): summary.txt and gpu_checks.json (the checks), gpu_logs.tgz (every
# log of the checks), fixture.tgz (the trained model's 5 files, probe.log, train.log, run.log),
# lease.log (this script's own lines).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/sparkinfer_lease}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/lease.XXXXXX)
mkdir -p "$OUT" "$WORK/gpu" "$WORK/fixture"
exec > >(tee "$OUT/lease.log") 2>&1

if compgen -G ".whl-gpu/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-gpu/*.whl \
    || { echo "installing .whl-gpu failed"; exit 2; }
  touch /tmp/site/.installed-by-lease  # run_gpu_checks.sh's env stage then leaves /tmp/site alone
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

TRAIN_S=${LEASE_TRAIN_S:-220}
(
  OUT=$WORK/fixture TRAIN_BUDGET_S=$TRAIN_S timeout -k 5 $((TRAIN_S + 60)) bash benchmarks/device/train_fixture.sh \
    >"$WORK/fixture/run.log" 2>&1
  echo "train_fixture.sh rc=$?" >>"$WORK/fixture/run.log"
  touch "$WORK/train.done"
) &
TRAIN_PID=$!

OUT=$WORK/gpu GPU_CHECKS_WAIT_FOR=$WORK/train.done GPU_CHECKS_BUDGET_S=${GPU_CHECKS_BUDGET_S:-530} \
  bash benchmarks/device/run_gpu_checks.sh "$@"  # e.g. --only tests,graph_exchange
rc=$?

if kill -0 "$TRAIN_PID" 2>/dev/null; then  # only if the checks ended early: its timeout ends it otherwise
  echo "fixture training still running: stopped"
  pkill -f sparkinfer.fixture.train; pkill -f train_fixture.sh
fi
wait "$TRAIN_PID" 2>/dev/null
cp "$WORK/gpu/summary.txt" "$WORK/gpu/gpu_checks.json" "$OUT/" 2>/dev/null
tar czf "$OUT/gpu_logs.tgz" -C "$WORK/gpu" .
tar czf "$OUT/fixture.tgz" -C "$WORK/fixture" .
echo "== fixture training (run.log tail)"
grep -v "^step .*0/" "$WORK/fixture/run.log" | tail -25
grep "^step" "$WORK/fixture/run.log" | tail -2
exit $rc
