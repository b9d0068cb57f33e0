#!/bin/bash
# PDL A/B on the device: the K3 step without, then with, programmatic dependent launch (two processes,
# one after the other, same machine), then the PDL equality test. JSON under $OUT.
# Run from the repository root with pyzmq/msgspec on PYTHONPATH (see bench/README.md).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 240 python3 -m draft_tools.bench.draft_step_gpu --presets k3 --skip prefill,server,exact \
  --out "$OUT/draft_step_h200_v11_nopdl.json" 2>&1 | grep -E "B=|mixed|profile:|floors|Error|error" | cut -c1-220
timeout 240 python3 -m draft_tools.bench.draft_step_gpu --presets k3 --skip prefill,server --pdl \
  --out "$OUT/draft_step_h200_v11.json" 2>&1 | grep -E "B=|mixed|profile:|floors|float32|Error|error" | cut -c1-220
timeout 100 python3 -m pytest -q -x --tb=short tests/gpu/test_pdl_gpu.py 2>&1 | grep -v Warning | tail -40
