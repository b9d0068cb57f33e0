#!/usr/bin/env bash
# EXL3 on a CUDA GPU box in one call: install exllamav3 1.6.5 from .whl/, load or JIT-build only its
# exllamav3_ext extension, then run a task, results under $OUT.
#
#   golden  exllamav3's goldens (draft_tools.exl3_golden, incl. the shipped tiny EXL3 drafter's modules):
#           $OUT/exl3_fixtures.tar.gz + a table of our CPU decoder against them (inner bit-exact, errors)
#   smoke   the GPU backend (draft_tools.exl3_smoke): K3-shape linears, the tiny EXL3 drafter under CUDA
#           graphs, a full-size random K3 EXL3 drafter's step time vs BF16 -> $OUT/exl3_smoke.json
#   bench   draft_tools.bench.exl3_h200: BF16 vs EXL3 (exllamav3-quantized) K3 drafters, the tiny drafter
#           through `draft-server quantize` -> $OUT/exl3_h200.json, $OUT/tiny_exl3_k4.tar.gz
#   kernel  draft_tools.bench.exl3_kernel: the Triton decode-GEMM's launch shapes vs exllamav3 and BF16, per
#           K3 linear and row count -> $OUT/exl3_kernel.json
#   all     golden, then smoke in the time left (does not fit 600 s when the build is not cached)
#   module  any Python module with the extension loaded (e.g. `module draft_tools.bench.ab --base X -- ...`)
# Extra arguments after the task go to the task's Python module (e.g. `bench --bits 4 --large recon`).
#
# The built extension comes back as $OUT/exl3_ext.so.z.part* (xz or gzip, 15 MB parts): put them in
# .exl3_prebuilt/ (git-ignored) and carry that folder, and the next call imports it instead of building.
#
# Device tool (one H200; .whl must hold exllamav3-1.6.5, pydantic 2.14.4, pydantic-core 2.50.5,
# annotated-types, typing-inspection, typing-extensions, msgspec and pyzmq wheels: README "EXL3"):
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash draft_tools/exl3_gpu.sh golden")
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash draft_tools/exl3_gpu.sh smoke")
# The build (~250-330 s at 16 jobs) lands in .torch_extensions/ (git-ignored), which a still-warm machine
# keeps between calls: a second call right after the first skips it. Then, here:
#   tar xzf <files_at>/exl3_fixtures.tar.gz -C tests/fixtures/exl3 && pytest tests/numerics/test_exl3_golden.py
# Outside the device tool: OUT=/some/dir bash draft_tools/exl3_gpu.sh golden (wheels from .whl/ if present).
set -uo pipefail
task=${1:-golden}
shift || true
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/exl3}
mkdir -p "$OUT"
limit=${EXL3_GPU_LIMIT_S:-585}  # the device tool's 600 s, less a margin for the copy back

source draft_tools/device_env.sh || exit 1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} EXL3_INT8_GEMV=0
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
export EXLLAMAV3_TUNE_CACHE=${EXLLAMAV3_TUNE_CACHE:-$TORCH_EXTENSIONS_DIR/exl3_autotune.bin}
export PYTHONUNBUFFERED=1
mkdir -p "$TORCH_EXTENSIONS_DIR"
if take_prebuilt .exl3_prebuilt/exl3_ext.so.z.part /tmp/exl3_prebuilt/exllamav3_ext.so; then  # a previous call's build
    export PYTHONPATH=/tmp/exl3_prebuilt:$PYTHONPATH && echo "prebuilt exllamav3_ext from .exl3_prebuilt"
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -1
  python3 -c "import torch, exllamav3.version as v; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'exllamav3', v.__version__)"
} 2>&1 | tee "$OUT/build.log"
python3 -c "from draft_server.models.exl3.cuda import load_ext; load_ext()" 2>&1 | tee -a "$OUT/build.log" || exit 1
echo "build done at ${SECONDS}s"
so=$(ls "$TORCH_EXTENSIONS_DIR"/exllamav3_ext/exllamav3_ext*.so 2>/dev/null | head -1)
if [ -n "$so" ] && [ ! -e /tmp/exl3_prebuilt/exllamav3_ext.so ]; then  # ship the build back for the next call
    ship_back "$so" "$OUT/exl3_ext.so.z.part"
    echo "packed at ${SECONDS}s"
fi

golden() {
    rm -rf /tmp/exl3_fixtures
    timeout "$(left)" python3 -m draft_tools.exl3_golden --out /tmp/exl3_fixtures \
        --checkpoint draft_tools/tiny_pair/assets/draft_exl3_k4 "$@" 2>&1 | tee "$OUT/golden.log"
    local rc=$?
    tar czf "$OUT/exl3_fixtures.tar.gz" -C /tmp/exl3_fixtures . && ls -l "$OUT/exl3_fixtures.tar.gz"
    echo "golden rc=$rc at ${SECONDS}s"
    return $rc
}
smoke() {
    timeout "$(left)" python3 -m draft_tools.exl3_smoke --out "$OUT/exl3_smoke.json" "$@" 2>&1 | tee "$OUT/smoke.log"
    local rc=$?
    echo "smoke rc=$rc at ${SECONDS}s"
    return $rc
}
bench() {
    timeout "$(left)" python3 -m draft_tools.bench.exl3_h200 --out "$OUT/exl3_h200.json" "$@" 2>&1 | tee "$OUT/bench.log"
    local rc=$?
    echo "bench rc=$rc at ${SECONDS}s"
    return $rc
}
kernel() {
    timeout "$(left)" python3 -m draft_tools.bench.exl3_kernel --out "$OUT/exl3_kernel.json" "$@" 2>&1 | tee "$OUT/kernel.log"
    local rc=$?
    echo "kernel rc=$rc at ${SECONDS}s"
    return $rc
}
case "$task" in
    golden) golden "$@" ;;
    smoke) smoke "$@" ;;
    bench) bench "$@" ;;
    kernel) kernel "$@" ;;
    golden+bench) golden; g=$?; bench "$@"; b=$?; exit $((g || b)) ;;
    module) timeout "$(left)" python3 -m "$@" 2>&1 | tee "$OUT/module.log"; exit "${PIPESTATUS[0]}" ;;
    all) golden; g=$?; smoke; s=$?; exit $((g || s)) ;;
    *) echo "usage: draft_tools/exl3_gpu.sh golden|smoke|bench|kernel|golden+bench|all|module [args]" >&2; exit 2 ;;
esac
