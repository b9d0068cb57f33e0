#!/usr/bin/env bash
# FlashMLA (K3's MLA on Hopper, README "MLA through FlashMLA") on a GPU box in one call: unpack the
# sources, build our binding (about 90 s on 16 cores, into .torch_extensions/, which a still-warm
# machine keeps), run a task, results under $OUT.
#
#   test    tests/gpu (the FlashMLA tests and the ingest tests)
#   probe   draft_tools.bench.flash_mla_probe: attention alone, FlashMLA vs our Triton kernel -> $OUT/flash_mla_probe.json
#   step    draft_tools.bench.flash_step: the K3 step, FlashMLA vs Triton drafter, one process -> $OUT/flash_step.json
#   bench   draft_tools.bench.draft_step_gpu --presets k3 --skip prefill,server,exact -> $OUT/draft_step.json
#   fused   draft_tools.bench.fused_step: the step with the fused kernels vs before them -> $OUT/fused_step.json
#   timeline draft_tools.bench.step_timeline: a step's host phases and GPU gaps -> $OUT/step_timeline.json (+ traces)
#   anatomy draft_tools.bench.step_anatomy --parts anatomy: a step's kernels by op and shape -> $OUT/step_anatomy.json
#   py MOD ARGS  python3 -m MOD ARGS with FlashMLA built (each MOD's --out under $OUT is the caller's to pass)
#   all     test, then step
#   pack SRC CUTLASS   (here, not on the device) .flashmla/flashmla_src.tgz from a deepseek-ai/FlashMLA
#           checkout and a CUTLASS checkout at FlashMLA's submodule pin (only what the build reads)
# Extra arguments after the task go to its Python module. The build comes back as $OUT/flash_mla-KEY.so.z.part*:
# moved into .flashmla/, the next call with the same sources and torch imports it instead of building.
#
# Device tool (one H200; .whl holds the msgspec and pyzmq wheels):
#   run(kind="nvidia-h200", carry=[".whl", ".flashmla"], timeout_s=600, command="bash draft_tools/flashmla_gpu.sh all")
set -uo pipefail
task=${1:-all}
shift || true
cd "$(dirname "$0")/.."

if [ "$task" = pack ]; then
    src=${1:?FlashMLA checkout}
    cutlass=${2:?CUTLASS checkout}
    tmp=$(mktemp -d)
    mkdir -p "$tmp/FlashMLA/csrc/cutlass/tools/util" .flashmla
    cp -r "$src"/csrc/{smxx,sm90,kerutils,params.h,utils.h,defines.h} "$tmp/FlashMLA/csrc/"
    cp "$src/LICENSE" "$tmp/FlashMLA/"
    cp -r "$cutlass/include" "$tmp/FlashMLA/csrc/cutlass/"
    cp -r "$cutlass/tools/util/include" "$tmp/FlashMLA/csrc/cutlass/tools/util/"
    cp "$cutlass/LICENSE.txt" "$tmp/FlashMLA/csrc/cutlass/"
    tar czf .flashmla/flashmla_src.tgz -C "$tmp" FlashMLA && rm -rf "$tmp" && ls -l .flashmla/flashmla_src.tgz
    exit $?
fi

OUT=${OUT:-$PWD/out/flashmla}
mkdir -p "$OUT"
limit=${FLASHMLA_GPU_LIMIT_S:-585}  # the device tool's 600 s, less a margin for the copy back
source draft_tools/device_env.sh || exit 1
if [ -z "${DRAFT_FLASHMLA_SRC:-}" ]; then
    [ -f .flashmla/flashmla_src.tgz ] || { echo "no .flashmla/flashmla_src.tgz (bash $0 pack SRC CUTLASS)"; exit 1; }
    mkdir -p /tmp/flashmla && tar xzf .flashmla/flashmla_src.tgz -C /tmp/flashmla || exit 1
    export DRAFT_FLASHMLA_SRC=/tmp/flashmla/FlashMLA
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
mkdir -p "$TORCH_EXTENSIONS_DIR"
# KEY (the header's flash_mla-KEY): the binding, the source tarball, torch and CUDA versions
key=$(python3 -c "
import hashlib, os, torch
h = hashlib.sha256()
for f in ('draft_server/models/kernels/flash_mla.cu', '.flashmla/flashmla_src.tgz', os.environ.get('DRAFT_FLASHMLA_SRC', '')):
    h.update(open(f, 'rb').read() if os.path.isfile(f) else f.encode())
h.update(f'{torch.__version__} {torch.version.cuda}'.encode())
print(h.hexdigest()[:12])") || exit 1
if take_prebuilt ".flashmla/flash_mla-$key.so.z.part" /tmp/flashmla_prebuilt/draft_flash_mla.so; then
    export PYTHONPATH=/tmp/flashmla_prebuilt:$PYTHONPATH && echo "prebuilt FlashMLA $key from .flashmla"
fi
python3 -c "
from draft_server.models.kernels import flash_mla as fm
assert fm.load() is not None, fm.why_not()" 2>&1 | tee "$OUT/build.log" || exit 1
echo "build done at ${SECONDS}s"
so="$TORCH_EXTENSIONS_DIR/draft_flash_mla/draft_flash_mla.so"
if [ -e "$so" ] && [ ! -e /tmp/flashmla_prebuilt/draft_flash_mla.so ]; then  # ship the build back for the next call
    ship_back "$so" "$OUT/flash_mla-$key.so.z.part"
fi

run_test() { timeout "$(left)" python3 -m pytest -q -x tests/gpu "$@" 2>&1 | tail -20 | tee "$OUT/test.log"; }
run_probe() { timeout "$(left)" python3 -m draft_tools.bench.flash_mla_probe --out "$OUT/flash_mla_probe.json" "$@"; }
run_step() { timeout "$(left)" python3 -m draft_tools.bench.flash_step --out "$OUT/flash_step.json" "$@" 2>&1 | grep -v Warn; }
run_bench() {
    timeout "$(left)" python3 -m draft_tools.bench.draft_step_gpu --presets k3 --skip prefill,server,exact \
        --out "$OUT/draft_step.json" "$@" 2>&1 | grep -v Warn | tail -40
}
run_fused() {
    timeout "$(left)" python3 -m draft_tools.bench.fused_step --out "$OUT/fused_step.json" "$@" 2>&1 | grep -v Warn
}
run_timeline() {
    timeout "$(left)" python3 -m draft_tools.bench.step_timeline --out "$OUT/step_timeline.json" "$@" 2>&1 | grep -v Warn
}
run_anatomy() {
    timeout "$(left)" python3 -m draft_tools.bench.step_anatomy --parts anatomy --out "$OUT/step_anatomy.json" "$@" \
        2>&1 | grep -v Warn
}
run_py() { timeout "$(left)" python3 -m "$@" 2>&1 | grep -v Warn; }
case "$task" in
    py) run_py "$@" ;;
    test) run_test "$@" ;;
    anatomy) run_anatomy "$@" ;;
    timeline) run_timeline "$@" ;;
    fused) run_fused "$@" ;;
    probe) run_probe "$@" ;;
    step) run_step "$@" ;;
    bench) run_bench "$@" ;;
    all) run_test && run_step "$@" ;;
    *) echo "unknown task $task (test, probe, step, bench, fused, timeline, anatomy, py, all, pack)"; exit 2 ;;
esac
rc=$?
echo "$task rc=$rc at ${SECONDS}s"
exit $rc
