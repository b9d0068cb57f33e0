#!/usr/bin/env bash
# draft-soak on one GPU with full-size random-weight K3 DSpark (bf16), for the device machine.
#   bash draft_tools/bench/gpu_soak.sh chaos       bf16: every chaos mode, 100 s, then a fault-free reference pass;
#                                      bf16 drafts depend on the batch (bench/results/gpu_batch_invariance.json),
#                                      so untouched sessions must agree on >= 75% of their draft tokens
#   bash draft_tools/bench/gpu_soak.sh chaos-fp32  the same in float32 (batch-invariant): drafts must be identical
#   bash draft_tools/bench/gpu_soak.sh memory      bf16, every chaos mode but kill (one long-lived server), 180 s:
#                                      does the server's GPU memory level off?
# Reports and plots go to $OUT (default ./out). pyzmq/msgspec (and psutil/matplotlib where the
# machine lacks them) come as wheels from .whl/ and .whl2/ (see bench/README.md).
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source draft_tools/device_env.sh
common=(--drafter dspark --model random:k3 --device cuda --server-arg=--kv-budget-mib=8192 --max-message-mib 256
  --prefill-rows 8,32 --long-prefill-rows 256 --engines 2 --sessions 16 --budget-ms 50 --pause-every-s 30
  --flood-every-s 40 --rogue-every-s 20 --vanish-every-s 20 --max-sessions 256 --session-ttl-s 10 --sample-s 1
  --rss-tolerance-mib 256 --gpu-tolerance-mib 512 --out "$OUT")
case "${1:-chaos}" in
  chaos)
    python3 -m draft_tools.soak "${common[@]}" --duration-s 100 --kill-every-s 45 --fuzz-messages 2000 \
      --mem-warmup-s 15 --mem-window 8 --seed 2 --reference-min-agreement 0.75 --report-name soak_gpu_k3.json ;;
  chaos-fp32)
    python3 -m draft_tools.soak "${common[@]}" --server-arg=--dtype=float32 --budget-ms 100 --duration-s 100 \
      --kill-every-s 45 --fuzz-messages 2000 --mem-warmup-s 15 --mem-window 8 --seed 2 \
      --report-name soak_gpu_k3_fp32.json ;;
  memory)
    python3 -m draft_tools.soak "${common[@]}" --chaos delay,drop,flood,fuzz,pause,rogue,slow,vanish \
      --duration-s 180 --fuzz-messages 3000 --no-reference --mem-warmup-s 30 --mem-window 20 --seed 3 \
      --report-name soak_gpu_k3_memory.json ;;
  *) echo "usage: $0 chaos|chaos-fp32|memory" >&2; exit 2 ;;
esac
