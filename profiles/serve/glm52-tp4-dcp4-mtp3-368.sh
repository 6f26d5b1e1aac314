#!/usr/bin/env bash
# GLM-5.2 on one node of 4 x RTX PRO 6000 Blackwell: TP4 / DCP4 / MTP3, 368-byte NVFP4 records.
#
#   profiles/serve/glm52-tp4-dcp4-mtp3-368.sh /models/glm-5.2 [more vllm serve flags]
#   profiles/serve/glm52-tp4-dcp4-mtp3-368.sh --print-args      # the vllm serve argv, one per line
#
# Needs the patched vLLM 0.32.0 of docker/Dockerfile (nvfp4_368 and the VLLM_SPARKINFER_*
# variables come from the sparkinfer patch series). Overridable from the environment:
#   KV_CACHE_DTYPE          nvfp4_368 (default) or nvfp4_432 (bf16 rope, 432-byte records)
#   MAX_MODEL_LEN           262144; `sparkinfer plan --kv-gb <KV GiB per GPU>` says what fits
#   GPU_MEMORY_UTILIZATION  0.92 (weights + activations + KV cache per GPU)
#   HOST, PORT              127.0.0.1, 8000 (benchmarks/serve_bench.py's default target)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The sparkinfer settings: exported, unless the caller already set them.
while IFS='=' read -r key value; do
    [[ -z "$key" || "$key" == \#* ]] && continue
    [[ -n "${!key:-}" ]] || export "$key=$value"
done < "$here/glm52-tp4-dcp4-mtp3-368.env"

args=(
    --tensor-parallel-size 4
    --decode-context-parallel-size 4            # the latent cache sharded over the 4 GPUs
    --kv-cache-dtype "${KV_CACHE_DTYPE:-nvfp4_368}"
    --block-size 64                             # sparse-MLA caches use 64-token pages
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'
    --max-model-len "${MAX_MODEL_LEN:-262144}"
    --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.92}"
    --served-model-name glm-5.2
    --host "${HOST:-127.0.0.1}"
    --port "${PORT:-8000}"
)

if [[ "${1:-}" == "--print-args" ]]; then
    printf '%s\n' "${args[@]}"
    exit 0
fi
if [[ $# -lt 1 ]]; then
    echo "usage: $0 MODEL_PATH [vllm serve flags...] | --print-args" >&2
    exit 2
fi
model="$1"
shift
exec vllm serve "$model" "${args[@]}" "$@"
