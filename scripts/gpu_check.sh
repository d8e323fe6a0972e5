#!/usr/bin/env bash
# The checks that need a GPU, in one go: the CUDA tests (tests/test_cuda.py, the CUDA RNG test) and, with
# --bench, the GPU benchmarks (fingerprint throughput, trace overhead at both configurations).
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--bench]    (--bench needs OUT_DIR first)
#
# Logs go to OUT_DIR (default gpu-check/). Exit 0 when every step passed. Set PYTHON to choose the interpreter.
set -u -o pipefail
out=${1:-gpu-check}
bench=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
rc=0
nvidia-smi -L 2>&1 | tee "$out/gpu.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
    2>&1 | tee -a "$out/gpu.txt" || rc=1
timeout 900 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_*_cuda.py tests/test_rng.py 2>&1 | tee "$out/tests.log" || rc=1
if [ "$bench" = "--bench" ]; then
    timeout 120 $py scripts/bench_fingerprint.py --devices cuda --size-mib 1024 2>&1 | tee "$out/bench_fingerprint.txt" || rc=1
    timeout 300 $py scripts/bench_trace.py --config both --blocks 6 --block-steps 20 --large-blocks 4 \
        --large-block-steps 10 --levels none state state/10 2>&1 | tee "$out/bench_trace.txt" || rc=1
fi
exit $rc
