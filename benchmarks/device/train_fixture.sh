#!/usr/bin/env bash
# Train the accuracy fixture on a lent GPU (issue 18: a fixture that copies, so retrieval at depth
# means something). On the 2-core CPU box the copy path forms too slowly (docs/research/2026-12-02-fixture-copy-attempts.md,
# copy attempts 1-5: at batch 16 for 1,000 steps, ~70 min, recalled-token top-1 reached 0.06-0.10 and
# exact recall stayed 0); batch 32+ for thousands of steps is seconds-per-hundred-steps on a GPU.
#
# The corpus is CPython 3.11.7's pydoc_data.topics; the H200 image's Python is 3.12, whose topics
# differ (and with them the BPE tokenizer), so the CPU machine's file travels with the call:
#   here:   mkdir -p .fixture-corpus && cp "$(python3 -c 'import pydoc_data.topics as t; print(t.__file__)')" \
#             .fixture-corpus/topics.py && echo /.fixture-corpus/ >> .git/info/exclude
#   device: run(command="bash benchmarks/device/train_fixture.sh", carry=[".fixture-corpus"], timeout_s=480)
# The script refuses to train when the corpus hash is not the shipped fixture's (recipe.json).
#
# What it does: a 30-step probe times a step on this GPU, then the recipe below runs for as many
# steps as fit TRAIN_BUDGET_S (default 330 s; 85% dense, 15% with the indexer's top-k applied), from
# the shipped fixture's weights, evaluating every 1,000 steps. The model's files land in $OUT (5 files:
# model.safetensors, config.json, recipe.json, tokenizer.json, tokenizer_config.json) with the log;
# copy them over sparkinfer/fixture/model here only if recipe.json's needle_recall is > 0 and the
# gate's other numbers hold (then regenerate the accuracy-gate rows and the docs' table).
# Needs on the image: torch, transformers (with GlmMoeDsa), tokenizers, safetensors (KINDS.md lists them).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/sparkinfer_fixture}
BUDGET=${TRAIN_BUDGET_S:-330}
BATCH=${BATCH:-32}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu BATCH=1 TRAIN_BUDGET_S=100: a smoke test of the script on a CPU box
WORK=$(mktemp -d /tmp/fixture.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPARKINFER_FIXTURE_TOPICS=${SPARKINFER_FIXTURE_TOPICS:-$PWD/.fixture-corpus/topics.py}
[ -f "$SPARKINFER_FIXTURE_TOPICS" ] || { echo "no corpus at $SPARKINFER_FIXTURE_TOPICS: carry .fixture-corpus (header)"; exit 2; }
want=$($PY -c "import json; print(json.load(open('sparkinfer/fixture/model/recipe.json'))['corpus_sha256'])")
got=$($PY -c "from sparkinfer.fixture import data; print(data.corpus_sha256())") || exit 2
[ "$want" = "$got" ] || { echo "corpus sha256 $got is not the shipped fixture's $want: carry CPython 3.11.7's topics.py"; exit 2; }

INIT_FROM=${INIT_FROM:-sparkinfer/fixture/model}  # or an earlier lease's model (carried with the corpus)
recipe=(--init-from "$INIT_FROM" --mix copy --supervise-heads --supervise-copy --batch "$BATCH"
        --lr 2e-3 --device "$DEVICE" --threads 4)
t0=$(date +%s)
$PY -m sparkinfer.fixture.train "$WORK/probe" "${recipe[@]}" --dense-steps 30 --sparse-steps 0 \
  >"$OUT/probe.log" 2>&1 || { tail -20 "$OUT/probe.log"; exit 1; }
# steps 21-30's time per step (the probe's last log line) into what is left of the budget once the
# run's own start-up (tokenizer, loading: the probe's wall time less its 30 steps) and the final
# evaluation and save (~30 s, a guess) are paid
probe_s=$(($(date +%s) - t0))
per_step=$(grep -o '[0-9.]* s/step' "$OUT/probe.log" | tail -1 | cut -d' ' -f1)
steps=$($PY -c "import sys; b, p, s = map(float, sys.argv[1:]); print(max(100, int((b - p - (p - 30 * s) - 30) / s) // 100 * 100))" \
  "$BUDGET" "$probe_s" "${per_step:-1}")
dense=$((steps * 85 / 100))
echo "probe: 30 steps in ${probe_s} s, ${per_step} s/step; training $steps steps ($dense dense) at batch $BATCH"
$PY -m sparkinfer.fixture.train "$WORK/model" "${recipe[@]}" --dense-steps "$dense" --sparse-steps $((steps - dense)) \
  --eval-every 1000 2>&1 | grep -v Warning | tee "$OUT/train.log"
for f in model.safetensors config.json recipe.json tokenizer.json tokenizer_config.json; do
  cp "$WORK/model/$f" "$OUT/" 2>/dev/null || echo "missing $f (the run did not finish)"
done
$PY -c "import json; h = json.load(open('$OUT/recipe.json'))['heldout']; print({k: h[k] for k in h if 'needle' in k or 'ppl' in k})"
