#!/usr/bin/env bash
# The checks that need two or more GPUs, within 10 minutes; each part has its own timeout:
#
#   devices  (90 s) a tensor on each GPU but the first, fingerprinted in a fresh thread (current device cuda:0),
#                   equals its CPU fingerprint, with every backend; no CUDA context is opened on GPU 0
#   save    (120 s) ckptverify.save of tensors on cuda:1: the writer's fingerprint thread records the CPU
#                   fingerprints and opens no context on GPU 0
#   dtensor (180 s) DTensors over an NCCL mesh of two GPUs (Shard, _StridedShard, a shard offloaded to the CPU)
#                   fingerprint as their full tensors, without a gather
#   remap   (120 s) a TrainState saved by a process seeing GPUs A,B (CUDA_VISIBLE_DEVICES) whose rank uses cuda:1
#                   (B), after drawing from its CUDA generator: a fresh process seeing only B (now cuda:0) restores
#                   that generator exactly; one seeing only A (another GPU) restores it with a restore-device
#                   finding in its load report (scripts/gpu_train_check.py --part remap)
#
# The timeouts add up to 510 s.
#
#   bash scripts/gpu_check_multi.sh [OUT_DIR] [--dry-run]
#
# --dry-run (or CKPTVERIFY_GPU_DRY_RUN=1) runs the same parts on the CPU with tiny sizes (Gloo for dtensor; remap
# saves and restores the CPU stream in a fresh process and skips its CUDA parts):
# tests/processes/test_gpu_scripts.py runs it. Logs go to OUT_DIR (default gpu-check-multi/). Exit 0 when every part
# passed. PYTHON picks the interpreter.
set -u -o pipefail
out=gpu-check-multi
dry=${CKPTVERIFY_GPU_DRY_RUN:-0}
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry=1 ;;
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
    gpus=$($py -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    if [ "$gpus" -lt 2 ]; then
        echo "needs two or more GPUs, found $gpus"
        exit 2
    fi
fi
part devices 90 $py scripts/gpu_parity.py --part devices "${flag[@]}"
part save 120 $py scripts/gpu_parity.py --part save "${flag[@]}"
part dtensor 180 $py scripts/gpu_parity.py --part dtensor "${flag[@]}"
part remap 120 $py scripts/gpu_train_check.py --part remap "${flag[@]}"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all parts passed"
