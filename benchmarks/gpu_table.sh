#!/usr/bin/env bash
# The GPU table of docs/benchmarks.md in one command, in the order of priority, each part under
# its own time limit (together 570 s), so one failure does not cost the others:
#   1. the FSDP tests on CUDA, one process (90 s);
#   2. the rollout alone, eager loop against engine.compiled_decode (static KV cache, CUDA
#      graphs), at the 124M and 0.5B presets (60 + 90 s), the compiled loop also with every
#      guard checked at every step, one compiled rollout profiled, and inductor's hints (a
#      CUDA graph it skips, say) in the log;
#   3. the training pass, eager against optimization.compile, GRPO at 124M (90 s);
#   4. GRPO end to end against TRL 1.16's GRPOTrainer at 124M and 0.5B in bf16, our side also
#      with both compiled options, MFU per phase and peak memory (100 + 140 s).
# Logs and JSON go to OUT (default: gpu_table/). Each preset's world (random weights at its
# shapes) is built once, under WORLDS, and reused by the later parts.
#
#   bash benchmarks/gpu_table.sh [OUT] [TRL_PYTHON]
#
# TRL_PYTHON: an interpreter that imports TRL 1.16.0 and rlkl_lightning (default: python3).
# The GPU machine's image lacks some of the project's packages; they travel as wheels in an
# ignored folder (docs/benchmarks.md, "On a GPU"): trl 1.16.0, datasets 5.2.0, dill 0.4.1,
# multiprocess 0.70.19, jsonargparse 4.53.0, docstring_parser 0.18.0, typeshed_client 2.14.0 and
# vaderSentiment 3.3.2, installed with --target into a folder that leads PYTHONPATH, then the
# checkout itself.
set -u
OUT=${1:-gpu_table}
TRL_PYTHON=$(command -v "${2:-python3}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RLKL_CACHE=${RLKL_CACHE:-/tmp/rlkl_cache}  # inductor's cache, shared by the parts
WORLDS=${WORLDS:-/tmp/rlkl_bench_worlds}
start=$(date +%s)
elapsed() { echo "($(($(date +%s) - start)) s in)"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pip list 2>/dev/null | grep -iE "^(pyarrow|datasets|fsspec|peft|accelerate) " \
  | tee -a "$OUT/gpu.txt"
python3 -c "import torch, transformers, lightning, trl; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'lightning', lightning.__version__, 'trl', \
trl.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

timeout 90 python3 -m pytest -q -p no:cacheprovider tests/system/test_fsdp.py -k cuda \
  >"$OUT/fsdp.log" 2>&1
echo "== fsdp cuda tests: exit $? $(elapsed)"
tail -3 "$OUT/fsdp.log"

compiled() {  # NAME LIMIT ARGS...: the rollout alone, eager against compiled
  local name=$1 limit=$2
  shift 2
  TORCH_LOGS=perf_hints timeout "$limit" python3 benchmarks/compiled_rollout.py --shape grpo \
    --device cuda --precision bf16-mixed --threads 4 --iters 3 --warmup 2 --profile \
    --every-guard \
    --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? $(elapsed)"
  grep -E "^(machine|  grpo|  compiled|  profiled|    )|cudagraph" "$OUT/$name.log" || tail -8 "$OUT/$name.log"
}
compiled rollout_124m 60 --preset gpt2-124m --world "$WORLDS/gpt2-124m"
compiled rollout_0.5b 90 --preset qwen2-0.5b --world "$WORLDS/qwen2-0.5b"

grpo() {  # NAME LIMIT ARGS...: GRPO iterations, sides alternating
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/grpo_throughput.py --device cuda --precision bf16-mixed \
    --threads 4 --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? $(elapsed)"
  grep -E "^(machine|rlkl|TRL|  |speedup|optimization|engine|iteration)" "$OUT/$name.log" \
    | grep -v Writing || tail -12 "$OUT/$name.log"
}
grpo update_124m 90 --preset gpt2-124m --world "$WORLDS/gpt2-124m" --compiled-update \
  --iters 3 --warmup 2
grpo grpo_124m 100 --preset gpt2-124m --world "$WORLDS/gpt2-124m" --vs-trl \
  --trl-python "$TRL_PYTHON" --compiled-update --compiled-decode --iters 4 --warmup 2
grpo grpo_0.5b 140 --preset qwen2-0.5b --world "$WORLDS/qwen2-0.5b" --vs-trl \
  --trl-python "$TRL_PYTHON" --compiled-update --compiled-decode --iters 3 --warmup 2
