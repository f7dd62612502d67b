#!/usr/bin/env bash
# The GPU table of docs/benchmarks.md in one command: GRPO against TRL's GRPOTrainer at the
# 124M and 0.5B shapes in bf16, the rollout's logits kept or recomputed, the FSDP tests on
# CUDA, and last (lowest priority) the rollout alone, eager loop against the compiled decode
# step (engine.compiled_decode: static KV cache, CUDA graphs) at both shapes. Each part has its
# own time limit, so one failure does not cost the others; logs and JSON go to OUT (default:
# gpu_table/). The compiled parts were written without a GPU at hand (their CPU runs are in
# docs/benchmarks.md): their first GPU run is also the first test of the CUDA-graph path.
#
#   bash benchmarks/gpu_table.sh [OUT] [TRL_PYTHON]
#
# TRL_PYTHON: an interpreter that imports TRL 1.16.0 and rlkl_lightning (default: python3).
set -u
OUT=${1:-gpu_table}
TRL_PYTHON=$(command -v "${2:-python3}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pip list 2>/dev/null | grep -iE "^(pyarrow|datasets|fsspec|peft|accelerate) " | tee -a "$OUT/gpu.txt"
python3 -c "import torch, transformers, lightning, trl; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'lightning', lightning.__version__, 'trl', \
trl.__version__)" | tee -a "$OUT/gpu.txt"
run() {  # NAME LIMIT ARGS...: one benchmark, its log and JSON in OUT
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/grpo_throughput.py --device cuda --vs-trl \
    --trl-python "$TRL_PYTHON" --threads 4 --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
  grep -E "^(machine|rlkl|TRL|  |speedup)" "$OUT/$name.log" | grep -v Writing || tail -20 "$OUT/$name.log"
}
run tiny 90 --tiny --iters 1 --warmup 1
run grpo_124m 200 --preset gpt2-124m --precision bf16-mixed --iters 5 --warmup 2
run grpo_qwen_0.5b 200 --preset qwen2-0.5b --precision bf16-mixed --iters 5 --warmup 2
# The scoring phase's memory with the rollout's logits kept and recomputed (the 124M shape's
# vocabulary and batch); it also checks that both give the same exact KL and entropy.
timeout 90 python3 benchmarks/rollout_memory.py --device cuda --batch 256 --new-tokens 64 \
  --repeats 1 --json "$OUT/rollout_memory.json" >"$OUT/rollout_memory.log" 2>&1
echo "== rollout memory: exit $?"
tail -4 "$OUT/rollout_memory.log"
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/system/test_fsdp.py -k cuda \
  >"$OUT/fsdp.log" 2>&1
echo "== fsdp cuda tests: exit $?"
tail -5 "$OUT/fsdp.log"
# Rollout only, eager against compiled (same prompts and seed; it prints the share of tokens
# that differ, which bf16 rounding may make nonzero); the warm-up iterations include
# torch.compile and the CUDA graphs' recording.
compiled() {  # NAME LIMIT ARGS...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/compiled_rollout.py --shape grpo --device cuda \
    --precision bf16-mixed --threads 4 --iters 5 --warmup 2 --json "$OUT/$name.json" "$@" \
    >"$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
  grep -E "^(machine|  grpo)" "$OUT/$name.log" || tail -20 "$OUT/$name.log"
}
compiled compiled_rollout_124m 150 --preset gpt2-124m
compiled compiled_rollout_qwen_0.5b 150 --preset qwen2-0.5b
