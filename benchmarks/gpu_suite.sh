#!/usr/bin/env bash
# Every GPU check of the project in one run, on a CUDA machine with torch, triton and transformers (vLLM is not
# needed: gpu_check stands in for the few vLLM objects it uses).  Each step has a time limit; logs and results
# go to DIR (default benchmarks/results/gpu), the step summary to stdout.  DEADLINE (seconds, default 540) caps
# the whole run: a step gets at most the time left, and one with under 20 s left is skipped.
#
#   bash benchmarks/gpu_suite.sh [DIR]
#
# Steps, in this order: gpu_check.py's full grid; the batch-1 pipeline sweep (profile_tree_attention.py); an
# Nsight Compute profile of the batch-1 kernel at the goal shape (where ncu is installed); the batch-1
# merge-variant sweep; the kernel tests compiled on the GPU; the kernel grid at batch 1, 8 and 64 (bench_kernels.py);
# drafter training steps on the GPU against the same steps on the CPU (train_speed.py).  SKIP="name ..." leaves
# steps out (e.g. SKIP="b1_variants train_cpu" where they were measured before).
set -u
DIR=${1:-benchmarks/results/gpu}
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# without an install, falcon_vllm.kernels is the top-level kernels/ folder (setup.py's package_dir): a link
# falcon_vllm/kernels -> ../kernels is made in the checkout (remove it after, or `pip install -e .` first)
python3 -c "import falcon_vllm.kernels" 2>/dev/null || ln -sfn ../kernels falcon_vllm/kernels
NAME=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")  # e.g. h100

DEADLINE=${DEADLINE:-540}
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "== $name: skipped (SKIP)"; return; fi
    ((limit > DEADLINE - SECONDS)) && limit=$((DEADLINE - SECONDS))
    if ((limit < 20)); then echo "== $name: skipped (deadline)"; return; fi
    timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $((SECONDS - start)) s"
    tail -n "${TAIL:-6}" "$DIR/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
# most important first: a step that runs out of deadline is skipped, not the ones before it (the kernels have not
# changed since their tests and grids last ran on an H100, so the batch-1 sweep and its profile come before them)
TAIL=16 step gpu_check 300 python3 benchmarks/gpu_check.py --name "gpu_check_$NAME" --out-dir "$DIR"
TAIL=14 step b1_pipeline 200 python3 benchmarks/profile_tree_attention.py --pipeline --name "kernels_b1_pipeline_$NAME" \
    --out-dir "$DIR"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [[ -n "$NCU" ]]; then  # --clock-control none: the card's clocks are left as found
    TAIL=40 step ncu_b1_goal 90 "$NCU" --clock-control none --kernel-name _tree_attn_fwd --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        python3 benchmarks/profile_tree_attention.py --launches 4
fi
TAIL=14 step b1_variants 150 python3 benchmarks/profile_tree_attention.py --name "kernels_b1_variants_$NAME" \
    --out-dir "$DIR"
TAIL=3 step kernel_tests 150 python3 -m pytest -q tests/test_kernels.py
for B in 1 8 64; do
    TAIL=2 step "kernels_b$B" 75 python3 benchmarks/bench_kernels.py --batch "$B" --name "kernels_${NAME}_b$B" \
        --out-dir "$DIR"
done
TAIL=8 step train_cuda 90 python3 benchmarks/train_speed.py --device cuda --bf16 --steps 40 \
    --out "$DIR/train_speed_${NAME}_cuda.json"
TAIL=8 step train_cuda_eagle 90 python3 benchmarks/train_speed.py --mode eagle --device cuda --bf16 --steps 40 \
    --out "$DIR/train_speed_${NAME}_cuda_eagle.json"
TAIL=8 step train_cpu 60 python3 benchmarks/train_speed.py --device cpu --steps 6 --threads 16 \
    --out "$DIR/train_speed_${NAME}_cpu16.json"
