#!/usr/bin/env bash
# The checks that need one GPU, in one go, within 10 minutes on one H200; each part has its own timeout, so a
# hung part costs its own time only and the others still run:
#
#   parity      (120 s) device fingerprints equal the CPU ones: every dtype and layout, paths fused (Triton)/eager,
#                       0-dim, empty, transposed, unaligned storage offset, indices past 2**32, a tensor of more
#                       than 2**32 elements where memory allows, under a non-default stream
#   many         (40 s) the many-tensor fingerprint equals eager; its peak extra memory stays bounded
#   tests       (240 s) the CUDA tests (tests/gpu/, the CUDA RNG test in tests/unit/test_rng.py) and the
#                       device-placement tests (tests/unit/test_fingerprint_devices.py)
#   throughput   (40 s) fingerprint GB/s per backend against clone
#   train        (90 s) a one-rank NCCL job trains a ~1B-parameter bf16 transformer (FSDP2, activation
#                       checkpointing) through ckptverify.Run at trace levels none / state / comm: per level the
#                       median step time, peak GPU memory and host synchronizations per step; fails when a level
#                       crashes (scripts/gpu_train_check.py --part train)
#   saveload     (40 s) ckptverify.save of a TrainState of a 1.5 GiB model on the GPU, ckptverify.load into a fresh
#                       one: peak GPU memory of each as a ratio of the state; fails when the load peaks above 1.3x
#                       (scripts/gpu_train_check.py --part saveload)
#   trace       (300 s) only with --bench, beyond the 10 minutes: trace overhead at both configurations
#
# The timeouts add up to 570 s (on an H200 the tests took 225 s, train 18 s, saveload 16 s).
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--dry-run] [--bench]
#
# --dry-run (or CKPTVERIFY_GPU_DRY_RUN=1) runs the Python parts on the CPU with tiny sizes (train over Gloo) and
# skips the GPU tests: tests/processes/test_gpu_scripts.py runs it, so CI proves the script works. Logs go to
# OUT_DIR (default gpu-check/). Exit 0 when every part passed; the parts that failed are listed at the end. PYTHON
# picks the interpreter. Two or more GPUs: scripts/gpu_check_multi.sh.
set -u -o pipefail
out=gpu-check
dry=${CKPTVERIFY_GPU_DRY_RUN:-0}
bench=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry=1 ;;
        --bench) bench=1 ;;
        *) out=$arg ;;
    esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
flag=()
if [ "$dry" = 1 ]; then flag=(--dry-run); fi
failed=()

part() {  # part NAME SECONDS COMMAND...: run COMMAND under its own timeout, log to OUT_DIR/NAME.log
    local name=$1 seconds=$2
    shift 2
    echo "== $name (timeout ${seconds}s)"
    if ! (cd "$here" && timeout "$seconds" "$@") 2>&1 | tee "$out/$name.log"; then
        failed+=("$name")
    fi
}

if [ "$dry" = 1 ]; then
    echo "dry run: CPU, tiny sizes" | tee "$out/gpu.txt"
else
    nvidia-smi -L 2>&1 | tee "$out/gpu.txt"
    $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
        2>&1 | tee -a "$out/gpu.txt" || failed+=(env)
fi
part parity 120 $py scripts/gpu_parity.py --part parity "${flag[@]}"
part many 40 $py scripts/gpu_parity.py --part many "${flag[@]}"
if [ "$dry" != 1 ]; then
    part tests 240 $py -m pytest -q -p no:cacheprovider tests/gpu \
        tests/unit/test_rng.py tests/unit/test_fingerprint_devices.py -m "not slow"
fi
part throughput 40 $py scripts/gpu_parity.py --part throughput "${flag[@]}"
part train 90 $py scripts/gpu_train_check.py --part train "${flag[@]}"
part saveload 40 $py scripts/gpu_train_check.py --part saveload "${flag[@]}"
if [ "$bench" = 1 ] && [ "$dry" != 1 ]; then
    part trace 300 $py scripts/bench_trace.py --config both --blocks 6 --block-steps 20 --large-blocks 4 \
        --large-block-steps 10 --levels none state state/10
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all parts passed"
