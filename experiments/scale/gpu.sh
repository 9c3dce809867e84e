#!/usr/bin/env bash
# The GPU rows of experiments/scale on one lent GPU, each mode one short run (about 8 minutes):
#   bash experiments/scale/gpu.sh           presets: decode steps against the memory roofline for
#       the presets that fit one GPU (bfloat16, batch 1, 8, 32) under the GPU defaults
#       (`cli.XLA_DEFAULTS`: weight products on cuBLAS), the 8B and 135M shapes also fused and
#       (8B, batch 1) fused and unrolled, r(T) and the one-block feature drafter's c for Llama 3.1
#       8B, the headline steps with Triton's GEMM fusions (the earlier default), then the other
#       presets (experiments/scale/gpu_cublas/<run>/);
#   bash experiments/scale/gpu.sh bars      the issue's GPU bars, each beside its baseline in the
#       same run, most important first: the 8B step fused and written out at batch 1, 8 and 32,
#       the default beside it, the scan written out over the stacked weights (`decode_unrolled`:
#       fused, as loaded, and without cuBLAS autotuning for its compile time) and a repeat; the
#       135M shape's float32 step written out over its stacked weights with and without o and
#       down stored output-major (`out_major`), beside its fastest timed layout (fused with the
#       attention kernel) and the fused step; the hand-written kernels' float32 sweep of their
#       programs (`Tiles.depth`, `split`, `columns`; at most 100 s); then Triton's GEMM fusions,
#       the 135M layouts with per-layer weights and in bfloat16, the 8B step either side of the
#       small-cache attention's limit (`layers.SMALL_CACHE_BYTES`) and the bfloat16 sweep, as
#       time allows (experiments/scale/gpu_bars2/<run>/);
#   bash experiments/scale/gpu.sh kernels   the hand-written kernels (configs/scale.py `pallas`)
#       and the attention kernel (`attn_kernel`) beside XLA's layers for the 135M, 8B and Gemma 3
#       1B shapes, the 8B default and two layouts at batch 1, 8 and 32, then the kernels' tile
#       sweeps (experiments/scale/pallas_tiles.py, within the time left)
#       (experiments/scale/gpu_bars/<run>/);
#   bash experiments/scale/gpu.sh costs     the per-preset rows not measured on a GPU yet: r(T)
#       and c for every preset that fits one GPU (the 8B's also written out and fused, its
#       fastest layout), what a dispatch per timed forward added to r and c
#       (experiments/scale/forward_dispatch.py), the theory's round cost against chain SD
#       decoded in turns (`check`), and the decode steps of qwen3-1.7b and gemma3-27b
#       (experiments/scale/gpu_costs/<run>/);
#   bash experiments/scale/gpu.sh levers    the layouts and XLA options at batch 1, each beside
#       the default in the same run: the layers written out with per-layer weights
#       (configs/scale.py `unrolled`, slow to compile: ~1-2 min each), q/k/v and gate/up fused
#       into one weight product each (`fused`), XLA's dynamic-slice fusion, XLA's own unrolling
#       of the layer loop, command buffers for the loop body, and the stopping while loop in
#       place of the fixed decode loop (experiments/scale/gpu_levers/<run>/).
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
#
# LIST=1 bash experiments/scale/gpu.sh [MODE] prints each step (name, configs/scale.py args,
# overrides; tab-separated) and each `sweep` ("sweep:NAME", pallas_tiles.py's flags) and runs
# nothing: tests/test_presets.py runs every step's checks and parses every sweep's flags on the
# CPU with it, so no config of the run is refused on the GPU.
set -u
OUT=${OUT:-/tmp/scale_gpu_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
if [ -n "${LIST:-}" ]; then :
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
W=experiments/scale/gpu
[ -n "${LIST:-}" ] || { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
  python3 -c "import jax; print(jax.devices())"
} >>"$LOG" 2>&1

# A 49,152-token stand-in vocabulary for the SmolLM2-135M shape (random weights and random
# prompts need no real tokenizer; its GGUF is too large to carry).
[ -n "${LIST:-}" ] || python3 - >>"$LOG" 2>&1 <<'EOF'
import tokenizers
vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, 49152)}}
tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>")).save(
    "/tmp/vocab49152.json")
EOF

step() {  # step NAME CONFIG_ARGS [--config.x=y ...]: one launch.py run, bounded by the deadline
  local name=$1 args=$2; shift 2
  local left=$((480 - SECONDS))
  if [ "$left" -lt 30 ]; then echo "== $name: skipped (deadline)" >>"$LOG"; return; fi
  echo "== $name (t=${SECONDS}s) XLA_FLAGS=${XLA_FLAGS:-}" >>"$LOG"
  # -k: a compiling XLA can outlive the polite signal; the call's own limit must not be reached.
  timeout -k 5 "$((left < 240 ? left : 240))" python3 launch.py \
      --config "configs/scale.py:$args" --workdir "$W/$name" "$@" >"$OUT/$name.out" 2>&1
  echo "   rc=$? ($((SECONDS))s)" >>"$LOG"
  # The rows themselves go in the log too, and the runs are packed after every step: the device
  # tool brings back a few files only, and the next call's copy of the working tree removes
  # files git does not ignore, results.json among them.
  cat "$W/$name/results.json" >>"$LOG" 2>/dev/null || tail -n 4 "$OUT/$name.out" >>"$LOG"
  rm -f "$OUT/$name.out"
  tar -czf "$OUT/scale_gpu.tar.gz" "$W" 2>>"$LOG"
}
sweep() {  # sweep NAME SECONDS [pallas_tiles.py args]: the tile sweep for at most SECONDS
  local name=$1 most=$2; shift 2
  local left=$((520 - SECONDS))
  [ "$left" -gt "$most" ] && left=$most
  if [ "$left" -lt 40 ]; then echo "== $name: skipped (deadline)" >>"$LOG"; return; fi
  echo "== $name (t=${SECONDS}s)" >>"$LOG"
  timeout -k 5 "$left" python3 experiments/scale/pallas_tiles.py "$@" --out "$W/$name" \
      --budget_s "$((left - 25))" >>"$LOG" 2>&1
  echo "   rc=$? ($((SECONDS))s)" >>"$LOG"
  tar -czf "$OUT/scale_gpu.tar.gz" "$W" 2>>"$LOG"
}
dispatch() {  # dispatch NAME [forward_dispatch.py args]: a dispatch against a compiled loop
  local name=$1; shift
  local left=$((480 - SECONDS))
  if [ "$left" -lt 40 ]; then echo "== $name: skipped (deadline)" >>"$LOG"; return; fi
  echo "== $name (t=${SECONDS}s)" >>"$LOG"
  timeout -k 5 "$((left < 180 ? left : 180))" python3 experiments/scale/forward_dispatch.py \
      "$@" --out "$W/$name" >>"$LOG" 2>&1
  echo "   rc=$? ($((SECONDS))s)" >>"$LOG"
  tar -czf "$OUT/scale_gpu.tar.gz" "$W" 2>>"$LOG"
}
if [ -n "${LIST:-}" ]; then
  step() { printf '%s' "$1"; shift; printf '\t%s' "$@"; printf '\n'; }
  sweep() { printf 'sweep:%s' "$1"; shift 2; printf '\t%s' "$@"; printf '\n'; }
  dispatch() { printf 'dispatch:%s' "$1"; shift; printf '\t%s' "$@"; printf '\n'; }
  dump() { :; }
fi
SMOL=(--config.model.size=smollm2-135m --config.tokenizer=/tmp/vocab49152.json)
# The launcher puts every weight product on cuBLAS (cli.XLA_DEFAULTS); this turns Triton's GEMM
# fusions back on, the XLA default before (the 8B batch-1 step: 11.7 ms with them, 5.7 without).
TRITON="--xla_gpu_enable_triton_gemm=true"
# Library calls with cuBLAS's default algorithm, not autotuned ones (compile time).
NOTUNE="--xla_gpu_autotune_level=0"
# Command buffers (CUDA graphs) for the loop body's kernels, the while loop included.
CMDBUF="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
dump() {  # dump NAME: $OUT/NAME.tar.gz, the optimized HLO of the step just run (at most 16 MiB)
  (cd "/tmp/$1" 2>/dev/null && tar -czf "$OUT/$1.tar.gz" ./*after_optimizations.txt) 2>>"$LOG"
}
DUMP="--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*generate.*"
# Dynamic-slice fusion: cuBLAS reads each layer's slice of the stacked weights in place.
DSF="--xla_gpu_enable_dynamic_slice_fusion=true"
# The layer scan (a while loop of known trip count) unrolled into straight-line code.
UNROLL="--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL"

W_BARS=experiments/scale/gpu_bars
B1=gpu,batch_sizes=1
SMOL_F=(--config.model.size=smollm2-135m:fused=1)
SMOL_P=(--config.model.size=smollm2-135m:fused=1:pallas=1)
SMOL_A=(--config.model.size=smollm2-135m:fused=1:attn_kernel=1)
if [ "${1:-presets}" = bars ]; then
  # The bars' best layouts of 2026-11-30 (results.md, "the bars") again, each beside what it
  # replaces in the same run, most important first (no step starts after 8 minutes): the 8B
  # bar (the nearest), then the 135M step's leads (the scan written out, o and down stored
  # output-major, beside the fastest timed layout), the hand-written kernels' sweep in float32
  # (their programs: `Tiles.depth`, `split`, `columns`), then the rest. Rows in gpu_bars2/
  # (gpu_bars/ holds the kernels mode's, 2026-11-30).
  W=experiments/scale/gpu_bars2
  # The 8B shape fused and written out at batch 1, 8 and 32 (both bars), beside the default.
  step llama3.1-8b-fused-unrolled-batches gpu,preset=llama3.1-8b,fused,unrolled
  step llama3.1-8b $B1,preset=llama3.1-8b
  # The candidate GPU default: the scan written out over the stacked weights (`decode_unrolled`,
  # no change of params or checkpoints): the unrolled layout's 340 kernels in one CUDA graph,
  # each weight product reading its layer's slice in place (kernels.json), fused and as loaded.
  step llama3.1-8b-fused-decode-unrolled $B1,preset=llama3.1-8b,fused,decode_unrolled
  step llama3.1-8b-decode-unrolled $B1,preset=llama3.1-8b,decode_unrolled
  # Its compile (~11 s a program written out on the GPU host, 1.8 s scanned) without cuBLAS's
  # algorithm autotuning (half the deviceless compile's time): compile_s and the step beside it.
  XLA_FLAGS="$NOTUNE" step llama3.1-8b-fused-decode-unrolled-notune \
      $B1,preset=llama3.1-8b,fused,decode_unrolled
  step llama3.1-8b-fused-unrolled-r2 $B1,preset=llama3.1-8b,fused,unrolled
  # The 135M shape in float32 written out over its stacked weights, with o and down stored
  # output-major (`out_major`: each one reduction kernel where XLA wrote the elementwise
  # product out and reduced it again: 320 kernels against 350, ~290 MB a step less traffic;
  # results.md, "Output-major weights"), and without; beside the fastest timed layout (fused
  # with the attention kernel, scanned) and the fused step.
  step smollm2-135m-f32-fused-decode-unrolled-out-major $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1:decode_unrolled=1:out_major=1
  # The same with the attention kernel (353 kernels: its own cost per kernel decides; scanned,
  # it took the 135M step from 1.70 to 1.40 ms for 29 kernels fewer).
  step smollm2-135m-f32-fused-decode-unrolled-out-major-attn $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1:decode_unrolled=1:out_major=1:attn_kernel=1
  step smollm2-135m-f32-fused-decode-unrolled $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1:decode_unrolled=1
  step smollm2-135m-f32-fused-attn $B1,dtype=float32 "${SMOL[@]}" "${SMOL_A[@]}"
  step smollm2-135m-f32-fused $B1,dtype=float32 "${SMOL[@]}" "${SMOL_F[@]}"
  # The hand-written products with more programs (at most 100 s of the call): the o and down
  # contractions shared by programs (`Tiles.depth`: ~160-220 programs with column blocks of 8,
  # 32 or 64 float32 columns, whole 32-256-byte segments of each weight row); the attention
  # over the 128-slot cache in four splits a kv head (`split=32`: 12 programs, not 3); narrower
  # column blocks (`Tiles.columns`: whether a product kernel is short of programs, 72 for the
  # 135M down product).
  sweep pallas-float32 100 --dtype float32 \
      --settings default,depth=4,depth=32,split=32,columns=4,columns=1,depth=16,columns=2
  # Unrolled, no weight is sliced out of a stack, so Triton's GEMMs copy nothing out first.
  XLA_FLAGS="$TRITON" step llama3.1-8b-fused-unrolled-triton $B1,preset=llama3.1-8b,fused,unrolled
  # The 135M step's products on XLA's Triton fusions (its 1.22 ms fused step of 2026-11-28 ran
  # under them; 1.70 ms on cuBLAS), and the written-out layout with per-layer weights: one CUDA
  # graph a step, 413 kernels with the attention kernel and 350 without (kernels.json).
  XLA_FLAGS="$TRITON" step smollm2-135m-f32-fused-attn-triton $B1,dtype=float32 "${SMOL[@]}" \
      "${SMOL_A[@]}"
  XLA_FLAGS="$TRITON" step smollm2-135m-f32-fused-triton $B1,dtype=float32 "${SMOL[@]}" \
      "${SMOL_F[@]}"
  step smollm2-135m-f32-fused-unrolled-attn $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1:unrolled=1:attn_kernel=1
  step smollm2-135m-f32-fused-unrolled $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1:unrolled=1
  XLA_FLAGS="$TRITON" step smollm2-135m-f32-fused-unrolled-attn-triton $B1,dtype=float32 \
      "${SMOL[@]}" --config.model.size=smollm2-135m:fused=1:unrolled=1:attn_kernel=1
  # In bfloat16 the attention kernel slowed the 8B step and the hand-written layers the 135M
  # step: the 135M shape in bfloat16, fused, with and without it, tells dtype from shape.
  step smollm2-135m-fused-attn $B1 "${SMOL[@]}" "${SMOL_A[@]}"
  step smollm2-135m-fused $B1 "${SMOL[@]}" "${SMOL_F[@]}"
  # Either side of layers.SMALL_CACHE_BYTES (4 MiB of K a layer: 2,048 slots at 8B): attention
  # over the cache reduced in place, then as matrix products, 3% more slots.
  step llama3.1-8b-fused-unrolled-s2048 $B1,preset=llama3.1-8b,fused,unrolled \
      --config.benchmark.prompt_tokens=1984
  step llama3.1-8b-fused-unrolled-s2112 $B1,preset=llama3.1-8b,fused,unrolled \
      --config.benchmark.prompt_tokens=2048
  sweep pallas-bfloat16 100 --dtype bfloat16 \
      --settings default,depth=4,depth=32,split=32,columns=4,columns=1,depth=16,columns=2
elif [ "${1:-presets}" = kernels ]; then
  # The hand-written kernels (`pallas`) and the attention kernel (`attn_kernel`) beside XLA's
  # layers, batch 1 unless named: measured 2026-11-30 (results.md, "the bars").
  W=$W_BARS
  step smollm2-135m-f32-fused $B1,dtype=float32 "${SMOL[@]}" "${SMOL_F[@]}"
  step smollm2-135m-f32-pallas $B1,dtype=float32 "${SMOL[@]}" "${SMOL_P[@]}"
  # The default at batch 1, 8 and 32: the batch-1 baseline and the throughput bar in one run.
  step llama3.1-8b-batches gpu,preset=llama3.1-8b
  # XLA's layers (products on cuBLAS) with one attention kernel a layer: 438 and 539 kernels a
  # step against 563 and 666 without (experiments/scale/kernels.json).
  step llama3.1-8b-fused-unrolled-attn $B1,preset=llama3.1-8b,fused,unrolled,attn_kernel
  step llama3.1-8b-fused-attn $B1,preset=llama3.1-8b,fused,attn_kernel
  step llama3.1-8b-fused-unrolled $B1,preset=llama3.1-8b,fused,unrolled
  step smollm2-135m-f32-fused-attn $B1,dtype=float32 "${SMOL[@]}" "${SMOL_A[@]}"
  step llama3.1-8b-pallas $B1,preset=llama3.1-8b,pallas
  step smollm2-135m-pallas $B1 "${SMOL[@]}" "${SMOL_P[@]}"
  step smollm2-135m-fused $B1 "${SMOL[@]}" "${SMOL_F[@]}"
  step llama3.1-8b-fused-attn-batches gpu,preset=llama3.1-8b,fused,attn_kernel
  step smollm2-135m-f32-pallas-batches gpu,dtype=float32 "${SMOL[@]}" "${SMOL_P[@]}"
  step gemma3-1b-fused $B1,preset=gemma3-1b,fused
  step gemma3-1b-pallas $B1,preset=gemma3-1b,pallas
  step gemma3-1b-fused-attn $B1,preset=gemma3-1b,fused,attn_kernel
  # The kernels' tiles (135M, float32), then the 8B shape's XLA fused layers, with the attention
  # kernel and on the kernels, in one process, each checked against XLA's greedy tokens.
  left=$((540 - SECONDS))
  echo "== pallas-tiles (t=${SECONDS}s)" >>"$LOG"
  if [ "$left" -ge 60 ] && [ -z "${LIST:-}" ]; then
    timeout -k 5 "$((left / 2))" python3 experiments/scale/pallas_tiles.py \
        --out "$W/pallas-tiles" --budget_s "$((left / 2 - 30))" >>"$LOG" 2>&1
    echo "   rc=$? ($((SECONDS))s)" >>"$LOG"
  fi
  left=$((540 - SECONDS))
  echo "== pallas-tiles-8b (t=${SECONDS}s)" >>"$LOG"
  if [ "$left" -ge 90 ] && [ -z "${LIST:-}" ]; then
    timeout -k 5 "$left" python3 experiments/scale/pallas_tiles.py --size llama3.1-8b \
        --dtype bfloat16 --steps 16 --settings default --out "$W/pallas-tiles-8b" \
        --budget_s "$((left - 60))" >>"$LOG" 2>&1
    echo "   rc=$? ($((SECONDS))s)" >>"$LOG"
  fi
elif [ "${1:-presets}" = costs ]; then
  # The per-preset rows no GPU has measured yet: r(T) for T = 1…64 and the c of each preset's
  # one-block feature drafter at batch 1 (the 8B's first in the fastest layout, since a ratio is
  # only as honest as its baseline's layout: results.md, "r(T) and c by layout"), then the decode
  # steps of the two presets without a row, then r(T) and c of the other presets, smallest first.
  W=experiments/scale/gpu_costs
  C1=gpu,cost,batch_sizes=1
  # (9 lengths: each is a program of ~11 s to compile written out)
  step llama3.1-8b-cost-fused-unrolled \
      $C1,preset=llama3.1-8b,fused,unrolled,tokens=1+2+3+4+5+8+16+32+64
  # What a dispatch and a wait added to each timed forward, r(5), c and the theory: one forward
  # a call (as r and c were timed before) against a compiled loop of forwards (cost_model's
  # timing since), in one process: the 135M shape, whose forwards last about as long as a
  # dispatch, and the 8B.
  dispatch smollm2-135m-f32-dispatch --arg gpu,dtype=float32 --size smollm2-135m \
      --tokenizer /tmp/vocab49152.json
  dispatch llama3.1-8b-dispatch --arg gpu,preset=llama3.1-8b
  # The theory's cost of a round, r(γ + 1) + γ·c, against chain SD decoded in turns with AR
  # (random weights and prompts: τ ≈ 1 at T = 0; γ = 2 and 4), and r(M) + Σ_w c(w) against the
  # dynamic tree of configs/scale.py's SUITE_TREE_TAU (dyn:8-32@4). Every cost run also gives
  # that tree's theory beside the chain's (the verifier on 33 tokens, the drafter on 8).
  step smollm2-135m-f32-check $C1,dtype=float32,check,tokens=1+3+5 \
      --config.verifier.size=smollm2-135m --config.drafter.size=smollm2-135m:first=1:features=1 \
      --config.tokenizer=/tmp/vocab49152.json
  step llama3.1-8b-check $C1,preset=llama3.1-8b,check,tokens=1+3+5
  step qwen3-1.7b gpu,preset=qwen3-1.7b
  step gemma3-27b gpu,preset=gemma3-27b
  for preset in qwen3-0.6b llama3.2-1b gemma3-1b qwen3-1.7b llama3.2-3b gemma3-4b qwen3-8b \
      gemma3-27b; do
    step "$preset-cost" "$C1,preset=$preset"
  done
elif [ "${1:-presets}" = levers ]; then
  # At batch 1 (the bars' batch size; one compiled program per run), most informative first.
  W=experiments/scale/gpu_levers
  B1=gpu,batch_sizes=1
  WHILE=--config.benchmark.loop=while  # the stopping while loop, beside the fixed default
  step llama3.1-8b $B1,preset=llama3.1-8b
  step llama3.1-8b-fused $B1,preset=llama3.1-8b,fused
  step smollm2-135m-f32 $B1,dtype=float32 "${SMOL[@]}"
  step smollm2-135m-f32-fused $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1
  XLA_FLAGS="--xla_dump_to=/tmp/hlo135-fused-unrolled $DUMP" \
    step smollm2-135m-f32-fused-unrolled $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1:unrolled=1
  dump hlo135-fused-unrolled
  XLA_FLAGS="$CMDBUF" step smollm2-135m-f32-fused-cmdbuf $B1,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1
  step llama3.1-8b-fused-unrolled $B1,preset=llama3.1-8b,fused,unrolled
  XLA_FLAGS="$DSF" step llama3.1-8b-dsf $B1,preset=llama3.1-8b
  XLA_FLAGS="$UNROLL" step llama3.1-8b-unroll-flag $B1,preset=llama3.1-8b
  step smollm2-135m-f32-while $B1,dtype=float32 "${SMOL[@]}" "$WHILE"
  step llama3.1-8b-while $B1,preset=llama3.1-8b "$WHILE"
else
  # The default run also dumps XLA's optimized HLO, so the kernels per decode step can be
  # counted here at no device time ($OUT/hlo*.tar.gz).
  W=experiments/scale/gpu_cublas  # experiments/scale/gpu holds the rows under Triton GEMMs
  XLA_FLAGS="--xla_dump_to=/tmp/hlo8b $DUMP" step llama3.1-8b gpu,preset=llama3.1-8b
  dump hlo8b
  # Fused: three weight products a layer fewer, each a kernel (~2 µs apiece at these sizes).
  step llama3.1-8b-fused gpu,preset=llama3.1-8b,fused
  # Fused and written out layer by layer (per-layer weights: no slicing of stacked weights, no
  # loop counter; ~1-2 min to compile), at the bars' batch size.
  step llama3.1-8b-fused-unrolled gpu,batch_sizes=1,preset=llama3.1-8b,fused,unrolled
  XLA_FLAGS="--xla_dump_to=/tmp/hlo135 $DUMP" step smollm2-135m-f32 gpu,dtype=float32 "${SMOL[@]}"
  dump hlo135
  step smollm2-135m-f32-fused gpu,dtype=float32 "${SMOL[@]}" \
      --config.model.size=smollm2-135m:fused=1
  step llama3.1-8b-cost gpu,cost,preset=llama3.1-8b,batch_sizes=1,tokens=1+2+3+4+5+8+16+32+64
  # The same steps with Triton's GEMM fusions, the XLA default before (measured against cuBLAS
  # at batch 1 on 2026-11-28; these add batch 8 and 32).
  XLA_FLAGS="$TRITON" step llama3.1-8b-triton gpu,preset=llama3.1-8b
  XLA_FLAGS="$TRITON" step smollm2-135m-f32-triton gpu,dtype=float32 "${SMOL[@]}"
  step qwen3-8b gpu,preset=qwen3-8b
  step llama3.2-1b gpu,preset=llama3.2-1b
  step smollm2-135m gpu "${SMOL[@]}"
  step gemma3-4b gpu,preset=gemma3-4b
  step llama3.2-3b gpu,preset=llama3.2-3b
  step gemma3-1b gpu,preset=gemma3-1b
  step qwen3-0.6b gpu,preset=qwen3-0.6b
fi
[ -n "${LIST:-}" ] && exit 0
tar -czf "$OUT/scale_gpu.tar.gz" "$W" 2>>"$LOG"
echo "done at ${SECONDS}s" >>"$LOG"
