#!/usr/bin/env bash
# The GPU rows of experiments/scale on one lent GPU, each mode one short run (about 8 minutes):
#   bash experiments/scale/gpu.sh           presets: decode steps against the memory roofline for
#       the presets that fit one GPU (bfloat16, batch 1, 8, 32), the 135M-shape step with and
#       without XLA command buffers for the loop body, r(T) and the one-block feature drafter's c
#       for Llama 3.1 8B (experiments/scale/gpu/<run>/);
#   bash experiments/scale/gpu.sh levers    the levers on the steps furthest from their roofline,
#       at batch 1, each beside its default: the layers written out with per-layer weights
#       (configs/scale.py `unrolled`), q/k/v and gate/up fused into one weight product each
#       (`fused`), XLA's dynamic-slice fusion, XLA's own unrolling of the layer loop, (8B)
#       cuBLAS for every weight product, (135M) small matrix-vector products kept as dots, and
#       the stopping while loop in place of the fixed decode loop, with three 8B runs'
#       optimized HLO (experiments/scale/gpu_levers/<run>/).
# Random weights, seeds 0 (verifier) and 1 (drafter). Every step is a launch.py command of
# configs/scale.py; the most important run first, and no step starts after 8 minutes, so what
# finished comes back even when the time runs out.
#
# Prepare here, once (the GPU image has JAX with CUDA, flax's dependencies and tokenizers; it
# lacks ml-collections, and flax is pinned as requirements.txt pins it):
#   echo /.whl/ >> "$(git rev-parse --git-dir)/info/exclude"
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp -d .whl ml-collections==1.1.0 flax==0.12.8
# Run with the device tool: command "bash experiments/scale/gpu.sh [levers]", carry [".whl"],
# timeout_s 600. $OUT/scale_gpu.tar.gz brings back the runs (results.json, results.md,
# config.json, log.txt), $OUT/hlo*.tar.gz the optimized HLO of the dumped runs and $OUT/log.txt
# the output; unpack it here with
#   tar -xzf <files_at>/scale_gpu.tar.gz
# then `python experiments/scale/collect.py` gathers the rows into results.json and prints the
# table for experiments/scale/results.md (one table per device kind).
set -u
OUT=${OUT:-/tmp/scale_gpu_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
W=experiments/scale/gpu
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
  python3 -c "import jax; print(jax.devices())"
} >>"$LOG" 2>&1

# A 49,152-token stand-in vocabulary for the SmolLM2-135M shape (random weights and random
# prompts need no real tokenizer; its GGUF is too large to carry).
python3 - >>"$LOG" 2>&1 <<'EOF'
import tokenizers
vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, 49152)}}
tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>")).save(
    "/tmp/vocab49152.json")
EOF

step() {  # step NAME CONFIG_ARGS [--config.x=y ...]: one launch.py run, bounded by the deadline
  local name=$1 args=$2; shift 2
  local left=$((480 - SECONDS))
  if [ "$left" -lt 30 ]; then echo "== $name: skipped (deadline)" >>"$LOG"; return; fi
  echo "== $name (t=${SECONDS}s)" >>"$LOG"
  timeout "$((left < 240 ? left : 240))" python3 launch.py --config "configs/scale.py:$args" \
      --workdir "$W/$name" "$@" >"$OUT/$name.out" 2>&1
  echo "   rc=$? ($((SECONDS))s)" >>"$LOG"
  tail -n 4 "$OUT/$name.out" >>"$LOG"; rm -f "$OUT/$name.out"
}
SMOL=(--config.model.size=smollm2-135m --config.tokenizer=/tmp/vocab49152.json)
# Command buffers (CUDA graphs) for the loop body's kernels, the while loop included, or none.
CMDBUF="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"

dump() {  # dump NAME: $OUT/NAME.tar.gz, the optimized HLO of the step just run (at most 16 MiB)
  (cd "/tmp/$1" 2>/dev/null && tar -czf "$OUT/$1.tar.gz" ./*after_optimizations.txt) 2>>"$LOG"
}
DUMP="--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*generate.*"
# Dynamic-slice fusion: cuBLAS reads each layer's slice of the stacked weights in place instead
# of XLA copying it out first (read, write, read again: 3× the weight bytes of a decode step).
DSF="--xla_gpu_enable_dynamic_slice_fusion=true"
# The layer scan (a while loop of known trip count) unrolled into straight-line code.
UNROLL="--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL"
# Weight products on cuBLAS only (Triton GEMM fusions off): a batch-1 step is matrix-vector.
NOTRITON="--xla_gpu_enable_triton_gemm=false"
# Small matrix-vector products kept as dots: XLA:GPU otherwise rewrites a dot this small (the
# 135M shape's [576, 1536] at batch 1) into a multiply fusion that writes the whole product
# and a reduction that reads it back.
NODSR="--xla_gpu_enable_dot_strength_reduction=false"

if [ "${1:-presets}" = levers ]; then
  # The levers on the two steps furthest from their roofline: 8B (3.2× the 4.3 TB/s roofline
  # on an H200) and the launch-bound 135M shape, each beside its default in the same run, at
  # batch 1 (the bars' batch size; one compiled program per run). Most informative first.
  W=experiments/scale/gpu_levers
  B1=gpu,batch_sizes=1
  WHILE=--config.benchmark.loop=while  # the stopping while loop, beside the fixed default
  XLA_FLAGS="--xla_dump_to=/tmp/hlo8b $DUMP" step llama3.1-8b $B1,preset=llama3.1-8b
  dump hlo8b
  XLA_FLAGS="--xla_dump_to=/tmp/hlo8b-unrolled $DUMP" \
    step llama3.1-8b-unrolled $B1,preset=llama3.1-8b,unrolled
  dump hlo8b-unrolled
  step llama3.1-8b-fused-unrolled $B1,preset=llama3.1-8b,fused,unrolled
  step smollm2-135m-f32 $B1,dtype=float32 "${SMOL[@]}"
  XLA_FLAGS="$NODSR" step smollm2-135m-f32-nodsr $B1,dtype=float32 "${SMOL[@]}"
  step smollm2-135m-f32-unrolled $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:unrolled=1
  XLA_FLAGS="$NODSR" step smollm2-135m-f32-fused-unrolled-nodsr $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1:unrolled=1
  XLA_FLAGS="$DSF --xla_dump_to=/tmp/hlo8b-dsf $DUMP" \
    step llama3.1-8b-dsf $B1,preset=llama3.1-8b
  dump hlo8b-dsf
  step llama3.1-8b-fused $B1,preset=llama3.1-8b,fused
  XLA_FLAGS="$NOTRITON" step llama3.1-8b-notriton $B1,preset=llama3.1-8b
  step smollm2-135m-f32-fused $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1
  XLA_FLAGS="$UNROLL" step llama3.1-8b-unroll-flag $B1,preset=llama3.1-8b
  XLA_FLAGS="$DSF" step smollm2-135m-f32-dsf $B1,dtype=float32 "${SMOL[@]}"
  step smollm2-135m-f32-while $B1,dtype=float32 "${SMOL[@]}" "$WHILE"
  step llama3.1-8b-while $B1,preset=llama3.1-8b "$WHILE"
else
  step llama3.1-8b gpu,preset=llama3.1-8b
  # The default run also dumps XLA's optimized HLO, so the kernels per decode step can be
  # counted here at no device time ($OUT/hlo135.tar.gz).
  XLA_FLAGS="--xla_dump_to=/tmp/hlo135 $DUMP" step smollm2-135m-f32 gpu,dtype=float32 "${SMOL[@]}"
  dump hlo135
  XLA_FLAGS="$CMDBUF" step smollm2-135m-f32-cmdbuf gpu,dtype=float32 "${SMOL[@]}"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
    step smollm2-135m-f32-no-cmdbuf gpu,dtype=float32 "${SMOL[@]}"
  step llama3.1-8b-cost gpu,cost,preset=llama3.1-8b,batch_sizes=1,tokens=1+2+3+4+5+8+16+32+64
  step llama3.2-1b gpu,preset=llama3.2-1b
  step smollm2-135m gpu "${SMOL[@]}"
  step qwen3-8b gpu,preset=qwen3-8b
  step gemma3-4b gpu,preset=gemma3-4b
  step llama3.2-3b gpu,preset=llama3.2-3b
  step gemma3-1b gpu,preset=gemma3-1b
  step qwen3-0.6b gpu,preset=qwen3-0.6b
fi

tar -czf "$OUT/scale_gpu.tar.gz" "$W" 2>>"$LOG"
echo "done at ${SECONDS}s" >>"$LOG"
