"""Evaluate autoregressive vs speculative decoding (SmolLM2 verifier, a trained drafter).

  python launch.py --config configs/evaluate.py --workdir runs/eval \
      --config.drafter.checkpoint=runs/quickstart/drafter
  python launch.py --config configs/evaluate.py:gammas=2+4+8,temperatures=0+1 --workdir runs/eval
  python launch.py --config configs/evaluate.py:smoke --workdir /tmp/eval   # tiny random models

Writes results.json (one row per method × γ × temperature × batch size, with every metric of the
glossary in docs/design.md §3, the seed and the device), results.md and tau_vs_gamma.png /
speedup_vs_gamma.png. Prompts: `num_prompts` prefixes of the Shakespeare test split (or
--config.prompts_file=FILE, which then replaces them: one prompt per line or JSON lines with a
"prompt" field; --config.data.name=spec_jax_pystdlib for code). `eval.num_prompts` is the one
count (the dataset column of results.json says where the prompts came from). Each prompt batch
is padded to the smallest width of eval.prompt_buckets, eval.prompt_buckets·2, ·4, ... (capped at
eval.max_prompt_tokens) that holds its longest prompt; --config.eval.prompt_buckets=0 pads every
batch to eval.max_prompt_tokens.
The default drafter, the quickstart's, is distilled on ShareGPT chat: the task suite
(experiments/specbench, or `configs/quickstart.py`'s table) decodes chat and code prompts with it;
for these Shakespeare prompts, `configs/quickstart.py:recipe=shakespeare` builds the drafter
distilled on Shakespeare (--config.drafter.checkpoint=<its workdir>/drafter).
Decoding on several devices: --config.mesh.data / fsdp / tensor (see configs/common.py: mesh).
Time on 2 CPU cores: ~1 min per (temperature, batch size, γ) with 8 prompts × 64 tokens.
One H100: γ ∈ {2, 4, 6} ×
T ∈ {0, 1} × batch {1, 8}, 8 prompts × 128 tokens, 3 timed passes each: 3.6 min
(experiments/gpu/results.md).
"""

from configs import common
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import methods


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, gammas="2+4+6", temperatures="0+1", batch_sizes="1",
                          num_prompts=8, new_tokens=64, drafter="runs/quickstart/drafter")
  config = common.base("evaluate")
  # One device by default; e.g. --config.mesh.data=-1 spreads each batch over every device,
  # --config.mesh.tensor=2 shards the models and KV heads (see common.mesh).
  config.mesh = common.mesh(data=1)
  config.title = "SmolLM2-135M-Instruct verifier, quickstart drafter"
  config.verifier = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.drafter = common.model(size="drafter-s", checkpoint=args.drafter)
  config.data = common.data()
  config.prompts = ()
  config.prompts_file = ""
  config.prompts_mix = False  # True: prompts_file adds to prompts and the data prompts
  config.num_data_prompts = args.num_prompts
  config.data_prompt_tokens = 64
  config.eval = dict(
      # Speculative methods run beside the autoregressive baseline, each NAME[:SHAPE][@L] with
      # NAME a registered method (spec_jax.decoding.methods; `python launch.py --config
      # configs/methods.py` lists them with their shapes and options).
      methods=("sd",),
      tree_width=3,      # K chains (specinfer/spectr), beam width W (rsd_s), root branching (rsd_c)
      tree_rule="auto",  # tree verification rule; auto = the one each tree's sampling needs
      gammas=common.plus_list(args, "gammas"),
      temperatures=common.plus_list(args, "temperatures", float),
      batch_sizes=common.plus_list(args, "batch_sizes"), num_prompts=args.num_prompts,
      new_tokens=args.new_tokens, max_prompt_tokens=96, top_k=0, top_p=1.0,
      # The smallest padded prompt width: a batch takes the smallest of 32, 64, ... (doubling,
      # then max_prompt_tokens) that holds its longest prompt, one compiled program per width;
      # 0 pads every batch to max_prompt_tokens. The padding is masked, so tokens do not depend
      # on it (up to float rounding); timings do (prefill).
      prompt_buckets=generate_lib.SMALLEST_BUCKET,
      rule="auto", lenience="lin", epsilon=1.0, stop_at_eos=False,
      relaxed_top_k=2,  # with rule='top_k_relaxed' (greedy, lossy): keep drafts in the top k
      epsilons=(),  # with rule='lenient': sweep these ε (one row each) instead of epsilon
      max_cache_len=8192,  # SmolLM2's context: prompt + new tokens + γ must fit
      save_text=False,     # True: every speculative run's continuations go to texts.jsonl
      # Every timed pass (autoregressive, drafter-only, speculative) runs each prompt batch this
      # many times and sums the per-batch medians: single passes vary by ±10-30% on a busy CPU.
      timing_repeats=1,
      # After each speculative row's timed pass, this many passes of it and of autoregressive
      # decoding taking turns batch by batch: paired_speedups (one per pass) and their median
      # paired_speedup, which a slow spell of a shared machine hits alike (0: none).
      timing_pairs=0,
      # Each method's options (eval.bpd for the BPD refinements, eval.lookup for prompt
      # lookup, ...), with the defaults their drafter modules declare
      # (spec_jax.decoding.methods.option_defaults); override a field with
      # --config.eval.<group>.<field>=VALUE.
      **methods.option_defaults())
  if args.smoke:
    config.tokenizer = "bytes"
    config.verifier = common.model(size="test-tiny")
    config.drafter = common.model(size="test-tiny")
    config.num_data_prompts = 3
    config.data_prompt_tokens = 16
    config.eval.update(gammas=(1, 3), temperatures=(0.0, 1.0), batch_sizes=(2,), num_prompts=3,
                       new_tokens=8, max_prompt_tokens=32)
    config.eval.bpd.rescorer = common.model(size="test-tiny")
  return config
