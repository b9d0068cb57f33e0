#!/usr/bin/env bash
# The hop and the critical path on a GPU box in one call (issues 12 and 17), results under $OUT:
#
#   test    tests/gpu/test_pinned_rows_gpu.py (PinnedRows with real device rows)
#   early   draft_tools.bench.early_taps_gpu over ipc + shm, B = 1, 16, 64: early taps, predicted
#           commits over the whole span and over the predicted rows only (with the commit hint and
#           without it), and the single message side by side; each run's server commit waits from
#           its metrics -> $OUT/early_taps.json
#   proj    the same with projected rows (--wire-format projected: 7168 values a row, not 35,840),
#           B = 16, 64 -> $OUT/early_taps_projected.json
#   prep    draft_tools.bench.cuda_ipc: tcp / ipc / shm / cuda_ipc with a K3 drafter, the taps'
#           device-to-host copy into pageable and into page-locked memory (PinnedRows) -> $OUT/cuda_ipc.json
#   ring    draft_tools.bench.ring_rows --device cuda: the taps' rows into the shm ring, copied in after a
#           page-locked copy vs written in place -> $OUT/ring_rows.json; then early_taps_gpu with the taps
#           on the GPU through the proposer's encoder, both ways, predicted commits, B = 8, 32, 64
#           -> $OUT/early_taps_ring.json
#   gap     draft-bench back to back, with 10 ms idle gaps (a target's forward) between calls, floor and
#           product alike, and with the gaps and --idle-spin-ms 20, 1 / 16 / 64 sessions, each beside the
#           client's wait_spin_ms 0.3 (--client-spin-ms) in the same run -> $OUT/rpc_gap*.json
#   sweep   draft_tools.bench.early_taps_gpu over ipc + shm, B = 1, 2, 4, 8, 16, 32, 64: predicted commits and
#           the single message side by side (issue 17's must-show 2) -> $OUT/early_taps_sweep.json
#   ab      predicted commits at 64 sessions, this tree against the tree in .abbase (``ab --export REV``,
#           carried), alternating, AB_ROUNDS (2) runs a side -> $OUT/early_taps_ab.json
#   rpcab   draft-bench (tcp / ipc / shm / shm in place / cuda_ipc, gRPC echo beside) at 1, 16, 64 sessions, this
#           tree against the tree in out/abbase (``python -m draft_tools.bench.ab --base REV --export out/abbase``
#           here, its bench/results and tests deleted, carried), AB_ROUNDS (2) runs a side -> $OUT/rpc_ab.json
#   service hop_marks beside the real K3 drafter (random:k3 on this GPU), 1 and 64 sessions, rows in place, 10 ms
#           gaps between steps (a target's forward): the engine sleeping, its idle spin around the client due
#           back (--idle-spin-ms 2), and that with the client spinning too (0.3 ms) -> $OUT/hop_service_*.json
#   all     test, early, proj, then prep in the time left
# Extra arguments after the task go to its Python module.
#
# Device tool (one H200; .whl holds the msgspec and pyzmq wheels):
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash draft_tools/hop_gpu.sh all")
set -uo pipefail
task=${1:-all}
shift || true
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/hop}
mkdir -p "$OUT"
limit=${HOP_GPU_LIMIT_S:-585}  # the device tool's 600 s, less a margin for the copy back
source draft_tools/device_env.sh || exit 1
export PYTHONUNBUFFERED=1
run_test() { timeout "$(left)" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pinned_rows_gpu.py "$@" 2>&1 | tail -5; }
early() {
    timeout "$(left)" python3 -m draft_tools.bench.early_taps_gpu --transport shm --batches 1,16,64 --steps 100 \
        --out "$OUT/early_taps.json" "$@" 2>&1 | grep -v Warn | tee "$OUT/early.log" | grep "^B="
}
sweep() {
    timeout "$(left)" python3 -m draft_tools.bench.early_taps_gpu --transport shm --batches 1,2,4,8,16,32,64 \
        --steps 150 --modes predicted_commit,single_message --out "$OUT/early_taps_sweep.json" "$@" 2>&1 \
        | grep -v Warn | tee "$OUT/sweep.log" | grep "^B="
}
ab() {
    timeout "$(left)" python3 -m draft_tools.bench.ab --base .abbase --rounds "${AB_ROUNDS:-2}" \
        --out "$OUT/early_taps_ab.json" -- draft_tools.bench.early_taps_gpu --transport shm --batches 64 --steps 200 \
        --modes predicted_commit "$@" 2>&1 | grep -v Warn | tee "$OUT/ab.log" | tail -6
}
rpcab() {
    timeout "$(left)" python3 -m draft_tools.bench.ab --base out/abbase --rounds "${AB_ROUNDS:-2}" \
        --out "$OUT/rpc_ab.json" -- draft_tools.bench.rpc --iters 200 --payloads k3 --sessions 1,16,64 "$@" 2>&1 \
        | grep -v Warn | tee "$OUT/rpcab.log" | tail -6
}
proj() {
    timeout "$(left)" python3 -m draft_tools.bench.early_taps_gpu --transport shm --wire-format projected \
        --batches 16,64 --steps 100 --out "$OUT/early_taps_projected.json" "$@" 2>&1 | grep -v Warn \
        | tee "$OUT/proj.log" | grep "^B="
}
prep() {
    timeout "$(left)" python3 -m draft_tools.bench.cuda_ipc --iters 60 --sessions 1,8,64 \
        --out "$OUT/cuda_ipc.json" "$@" 2>&1 | grep -v Warn | tail -12
}
ring() {
    timeout "$(left)" python3 -m draft_tools.bench.ring_rows --device cuda --out "$OUT/ring_rows.json" 2>&1 \
        | grep -v Warn | tail -9
    timeout "$(left)" python3 -m draft_tools.bench.early_taps_gpu --transport shm --batches 8,32,64 --steps 100 \
        --modes predicted_commit --encode host,ring,host,ring --taps-device cuda --out "$OUT/early_taps_ring.json" \
        "$@" 2>&1 | grep -v Warn | tee "$OUT/ring.log" | grep "^B="
}
gap() {
    for run in "0 0" "10 0" "10 20"; do
        set -- $run
        timeout "$(left)" python3 -m draft_tools.bench.rpc --iters 150 --gap-ms $1 --idle-spin-ms $2 \
            --client-spin-ms 0.3 --sessions 1,16,64 --out "$OUT/rpc_gap$1_spin$2.json" 2>&1 | grep -E "^(empty|k3)"
    done
}
service() {
    local k3="--model random:k3 --device cuda --kv-budget-mib 16384"
    for run in "0 0" "2 0" "2 0.3"; do
        set -- $run
        echo "== idle-spin-ms $1, client-spin-ms $2"
        timeout "$(left)" python3 -m draft_tools.bench.hop_marks --sessions 1,64 --in-place --steps 600 --gap-ms 10 \
            --client-spin-ms $2 --server-args "$k3 --idle-spin-ms $1" --out "$OUT/hop_service_spin$1_client$2.json" \
            2>&1 | grep -E "^sessions|read by|total"
    done
}
case "$task" in
    test) run_test "$@" ;;
    service) service ;;
    ring) ring "$@" ;;
    gap) gap "$@" ;;
    early) early "$@" ;;
    sweep) sweep "$@" ;;
    ab) ab "$@" ;;
    rpcab) rpcab "$@" ;;
    proj) proj "$@" ;;
    prep) prep "$@" ;;
    all) run_test; early; proj; prep ;;
    *) echo "usage: draft_tools/hop_gpu.sh test|early|sweep|ab|rpcab|proj|prep|ring|gap|service|all [args]" >&2; exit 2 ;;
esac
rc=$?
echo "$task rc=$rc at ${SECONDS}s"
exit $rc
