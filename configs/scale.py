r"""Speed at the sizes researchers run: an architecture preset (spec_jax/models/presets.py, e.g.
llama3.1-8b) with random weights (seed 0; its drafter seed 1), and either its autoregressive
decode step against the memory roofline (program `benchmark`, random prompts of 64 tokens), or,
with `cost`, the verifier's r(T) and the c of its one-block feature drafter (one block of the
verifier's shape with its own embedding and output head, `presets.block_drafter`), with the
theoretical speedup at the τ SmolLM2's task suite and its best in-domain drafter measured for
that kind of drafter, and the τ at which it breaks even (program `cost_model`).

CPU (float32, batch 1, T ≤ 16; on an idle machine: time nothing while anything else runs):
  python launch.py --config configs/scale.py:preset=llama3.2-1b \
      --workdir experiments/scale/cpu/llama3.2-1b
  python launch.py --config configs/scale.py:preset=llama3.2-1b,cost \
      --workdir experiments/scale/cpu/llama3.2-1b-cost
Every preset up to llama3.2-3b runs on a 24 GiB machine in float32, scanned or written out
(`fused,unrolled`; the 3B written out peaks at 17.7 GB in the memory-minimising order the
launcher gives XLA:CPU on one device, ~36 GB in XLA's own), at batch 1, 8 and 32; gemma3-4b
scanned (16.9 GB at batch 1 and 8; written out 23.6 GB, at the edge; its cost run does not
fit); the 8B presets fit in neither dtype (XLA:CPU keeps float32 copies of bfloat16 weights,
and bfloat16 steps are slower than float32 ones there), e.g.
  python launch.py --config configs/scale.py:preset=qwen3-1.7b,batch_sizes=1+8,fused,unrolled \
      --workdir experiments/scale/cpu/qwen3-1.7b-fused-unrolled
  python launch.py --config configs/scale.py:preset=qwen3-0.6b,batch_sizes=1+32,repeats=3 \
      --workdir experiments/scale/cpu/qwen3-0.6b-b1-b32
GPU (`gpu`: bfloat16, batch 1, 8 and 32, T = 1…64): experiments/scale/gpu.sh runs the presets
that fit one GPU, most important first (`gpu.sh costs`: r(T) and c of each), e.g.
  python launch.py --config configs/scale.py:gpu,preset=llama3.1-8b \
      --workdir experiments/scale/gpu/llama3.1-8b
  python launch.py --config configs/scale.py:gpu,cost,batch_sizes=1,preset=qwen3-0.6b \
      --workdir experiments/scale/gpu_costs/qwen3-0.6b-cost
Smoke (test-tiny, seconds): configs/scale.py:smoke and configs/scale.py:smoke,cost.
A cost run times the drafter with three output layers (`drafter_vocabs`, default 0+32000+8192):
the verifier's whole vocabulary (0), EAGLE-3's 32,000-token draft vocabulary of Llama 3.1 8B,
and the 8,192 tokens of the SmolLM2 drafters whose τ the theory rows use; rows carry `vocab`.
It also gives the theory of the dynamic tree the task suite measured beside the chain
(SUITE_TREE_TAU, rows "tree_theory"): the verifier timed on the tree's 33 tokens, the drafter on
each call's tokens (1, 8, 8, 8), the chain's theory at the same depth beside it.
`timings=3` takes three timings, 15 and 30 s apart, and keeps the one whose verifier one-token
forward (cost) or first batch size's decode (benchmark) ran fastest: a shared VM's slow spells
run them ~3× slower (rows carry timings and reference_spread), e.g.
configs/scale.py:preset=llama3.2-1b,cost,timings=3. A cost run times the verifier's and the
drafters' forwards in turns in one timing per batch size.
A cost run's timed forward is one call of a compiled loop of forwards, as many as last ~50 ms
(`cost.passes`; rows carry `passes`), as a decoding loop runs them; one forward a call would add
a dispatch and a wait to each. experiments/scale/forward_dispatch.py times both in one process,
with r, c and the theory from each (2 CPU cores: seconds), e.g.
  python experiments/scale/forward_dispatch.py --arg preset=smollm2-135m --tokenizer smollm2 \
      --out experiments/scale/cpu/smollm2-135m-dispatch
With `check`, a cost run also decodes chain SD (γ = 2 and 4, greedy) and the tree in turns with
AR on two random 64-token prompts: random weights give τ = 1, so its speedup checks the theory's
cost of a round, r(γ + 1) + γ·c and r(M) + Σ_w c(w), alone (2 CPU cores: 2 min), e.g.
  python launch.py --config configs/scale.py:preset=smollm2-135m,cost,check,tokens=1+3+5 \
      --config.tokenizer=smollm2 --workdir experiments/scale/cpu/smollm2-135m-check
Layouts of the same model (rows carry them): `fused`, q/k/v and gate/up as one weight product
each (`model.size=<preset>:fused=1`, two products per layer fewer); `unrolled`, the layers
written out with per-layer weights instead of a scan over stacked ones (`:unrolled=1`); e.g.
configs/scale.py:gpu,fused,unrolled; `decode_unrolled`, the prefill and decoding calls' layer scan
written out over the same stacked weights (`:decode_unrolled=1`: the unrolled layout's kernels
without its params, counted for an H200 in experiments/scale/kernels.json; on 2 CPU cores it
keeps the scanned step's time); `out_major`, each block's o and down weights stored output axis
first (`:out_major=1`: on a GPU XLA reduces a small model's float32 products itself, and two of
the 135M layer's four become one kernel each; slower on 2 CPU cores); `pallas`, the decoding
calls' layers as five hand-written GPU kernels each (`:fused=1:pallas=1`,
spec_jax/models/pallas_layers.py; ~6 kernels a layer against XLA's ~19-26), e.g.
configs/scale.py:gpu,pallas,batch_sizes=1 (experiments/scale/gpu.sh bars runs it beside the XLA
layers); `attn_kernel`, XLA's layers with each decoding call's attention as one hand-written
kernel (`:attn_kernel=1`, 4-5 kernels a layer fewer; the weight products stay on cuBLAS), e.g.
configs/scale.py:gpu,preset=llama3.1-8b,fused,unrolled,attn_kernel.

Rows: the programs' results.json (benchmark: preset, device, device_kind, dtype, batch_size,
ms_per_step, roofline_ms_per_step, vs_roofline, ...; cost_model: T, r, c, roofline_ms, and
model "theory" rows). experiments/scale/results.md collects them, one table per device kind.
Time on 2 CPU cores: 0.6–1.5 min a run at batch 1 for qwen3-0.6b to qwen3-1.7b, 2–5 min at batch
1 and 8, 3–7.5 min at batch 1 and 32 (repeats=3), 3 min for llama3.2-3b at batch 1 and 18 min
at batch 1, 8 and 32, 2.5–3 min for gemma3-4b at batch 1 (repeats=3) and 8.5 min at batch 1
and 8, 0.6–2.2 min a cost run;
on one H200, 10–25 s per preset and program (the written-out 8B: ~60 s).
Reference numbers (experiments/scale/results.md, one H200, weight products on cuBLAS, the
launcher's GPU default `cli.XLA_DEFAULTS`): Llama 3.1 8B batch 1 decode step 5.65 ms, 1.49× the
roofline of the run's own read (the weights it reads: all but the gathered input embedding),
5.09 ms `fused,unrolled` (1.35×; the issue's target: ≤ 1.3×), 11.66 ms with Triton GEMM fusions;
batch 32 throughput 26× batch 1 (target ≥ 20×); the 135M-shape float32 step 1.70 ms `fused`
(13× its roofline), 1.40 ms `fused,attn_kernel` (10×), 1.87 ms `pallas` (target ≤ 3×).
On 2 CPU cores the 1B decode step takes 285 ms scanned, 127 ms `unrolled` and 96 ms `fused`
and `unrolled` (the same model; experiments/scale/results.md, "the layouts"); on another 2-core
VM, batch 1, scanned / `fused,unrolled`: qwen3-0.6b 175 / 90 ms, gemma3-1b 291 / 135 ms,
llama3.2-1b 327 / 167 ms, qwen3-1.7b 545 / 233 ms, llama3.2-3b 1108 ms scanned ("every preset",
in XLA:CPU's own order); in the launcher's one-device memory order, scanned: qwen3-0.6b 109 ms,
gemma3-1b 206–222 ms, qwen3-1.7b 429–434 ms, llama3.2-1b unchanged; llama3.2-3b written out
441 ms ("scheduling order"); gemma3-4b 1370 / 565 ms ("Gemma 3 4B").
"""

from configs import common

# τ that one-block feature drafters of SmolLM2-135M-Instruct measured at γ = 4, greedy: the
# task suite's mean over its nine categories (the main job's ShareGPT drafter, `sd`:
# experiments/specbench/results.md), then the best in-domain drafter (features-1-v8k-long on
# Shakespeare: experiments/drafters/results.md). Random weights cannot give τ; the theory rows
# show what each τ would buy at this verifier's r and this drafter's c, and every theory row
# carries the τ at which speculative decoding breaks even, r(γ + 1) + γ·c.
SUITE_TAU = ((4, 1.34), (4, 2.33))
# The dynamic tree beside the chain on the same task suite, the same drafter and prompts, at T = 1
# (experiments/dyn/suite_t1): (method entry, the tree's τ, the chain's τ at the tree's depth).
# A cost run also times the verifier on the tree's M tokens and the drafter on each call's
# tokens (`TreeSpec.call_widths`: the root's 1, then frontiers of K) for the tree's theory.
SUITE_TREE_TAU = (("dyn:8-32@4", 1.76, 1.44),)


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, cost=False, check=False, gpu=False,
                          preset="llama3.2-1b",
                          dtype="", batch_sizes="", tokens="", new_tokens=0, repeats=5,
                          timings=1,
                          drafter_vocabs="0+32000+8192",
                          fused=False, unrolled=False, decode_unrolled=False, out_major=False,
                          pallas=False, attn_kernel=False)
  dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
  args.batch_sizes = args.batch_sizes or ("1+8+32" if args.gpu else "1")
  args.tokens = args.tokens or ("1+2+3+4+5+6+8+12+16+24+32+48+64" if args.gpu
                                else "1+2+3+4+5+6+8+12+16")
  batch_sizes, tokens = common.plus_list(args, "batch_sizes"), common.plus_list(args, "tokens")
  config = common.base("cost_model" if args.cost else "benchmark")
  config.config_file = "configs/scale.py" + (f":{arg}" if arg else "")
  config.tokenizer = "bytes"  # random prompts: any tokenizer whose ids fit the preset's vocabulary
  config.mesh = common.mesh(data=1)
  size = (("test-tiny" if args.smoke else args.preset)
          + (":fused=1" if args.fused or args.pallas else "")
          + (":unrolled=1" if args.unrolled else "")
          + (":decode_unrolled=1" if args.decode_unrolled else "")
          + (":out_major=1" if args.out_major else "")
          + (":pallas=1" if args.pallas else "")
          + (":attn_kernel=1" if args.attn_kernel else ""))
  if args.cost:
    config.verifier = common.model(size=size, dtype=dtype)
    # The one-block feature drafter of that verifier, random (cost_model: no checkpoint).
    config.drafter = common.model(size=f"{size}:first=1:features=1", dtype=dtype)
    # passes: forwards a timed call runs in one compiled loop (0: as many as last ~50 ms);
    # drafter_vocabs: that drafter's output layer over all tokens (0), EAGLE-3's 32,000 for
    # Llama 3.1 8B, and the 8,192 of the drafters that measured SUITE_TAU; timings: per batch
    # size, pause_s apart (then doubling), the one whose verifier one-token forward ran fastest
    # kept (on a shared VM 3: its slow spells slow the one-token forward ~3×).
    config.cost = dict(tokens=tokens, batch_sizes=batch_sizes, repeats=args.repeats,
                       timings=args.timings, pause_s=15.0,
                       position=128, bandwidth_mb=512, passes=0, theory=SUITE_TAU,
                       tree_theory=SUITE_TREE_TAU, check={},
                       drafter_vocabs=common.plus_list(args, "drafter_vocabs"))
    if args.check:  # the theory against chain SD decoded in turns with AR, random prompts
      config.cost.check = dict(gammas=(2, 4), temperatures=(0.0,), num_prompts=2,
                               prompt_tokens=64, new_tokens=64, repeats=args.repeats,
                               prompts="random")
    if args.smoke:
      config.cost.update(tokens=(1, 2, 5), batch_sizes=(1, 2), repeats=1, position=8,
                         bandwidth_mb=16, tree_theory=(("dyn:2-4@4", 1.5, 1.3),))
      if "drafter_vocabs" not in common.given(arg):
        config.cost.drafter_vocabs = (0, 64)
      if args.check:
        config.cost.check.update(gammas=(2,), prompt_tokens=8, new_tokens=8, repeats=1)
    return config
  config.model = common.model(size=size, dtype=dtype)
  config.data = common.data()  # unused: random prompts
  config.sampling = common.sampling()
  config.benchmark = dict(batch_sizes=batch_sizes,
                          new_tokens=args.new_tokens or (64 if args.gpu else 16),
                          prompt_tokens=64, repeats=args.repeats, prompts="random",
                          timings=args.timings, pause_s=15.0,
                          loop="fixed")  # or "while": the loop that stops on stop tokens
  if args.smoke:
    config.benchmark.update(batch_sizes=(1, 2), new_tokens=4, repeats=1, prompt_tokens=8)
  return config
