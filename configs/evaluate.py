"""Evaluate autoregressive vs speculative decoding (SmolLM2 verifier, a trained drafter).

  python launch.py --config configs/evaluate.py --workdir runs/eval \
      --config.drafter.checkpoint=runs/quickstart/drafter
  python launch.py --config configs/evaluate.py:gammas=2+4+8,temperatures=0+1 --workdir runs/eval
  python launch.py --config configs/evaluate.py:smoke --workdir /tmp/eval   # tiny random models

Writes results.json (one row per method × γ × temperature × batch size, with every metric of the
glossary in DESIGN.md §3, the seed and the device), results.md and tau_vs_gamma.png /
speedup_vs_gamma.png. Prompts: `num_prompts` prefixes of the Shakespeare test split (or
--config.prompts_file=FILE, which then replaces them: one prompt per line or JSON lines with a
"prompt" field; --config.data.name=spec_jax_pystdlib for code). `eval.num_prompts` is the one
count (the dataset column of results.json says where the prompts came from).
Decoding on several devices: --config.mesh.data / fsdp / tensor (see configs/common.py: mesh).
Time on 2 CPU cores: ~1 min per (temperature, batch size, γ) with 8 prompts × 64 tokens (the
quickstart's 2-temperature, 1-γ grid with 4 prompts × 48 tokens took 75 s). One H100: γ ∈ {2, 4, 6} ×
T ∈ {0, 1} × batch {1, 8}, 8 prompts × 128 tokens, 3 timed passes each: 3.6 min
(experiments/gpu/results.md).
"""

from configs import common


def _floats(s: str) -> tuple[float, ...]:
  return tuple(float(x) for x in s.split("+") if x)


def _ints(s: str) -> tuple[int, ...]:
  return tuple(int(x) for x in s.split("+") if x)


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
  config.num_data_prompts = args.num_prompts
  config.data_prompt_tokens = 64
  config.eval = dict(
      # Speculative methods run beside the autoregressive baseline: sd, specinfer, spectr, rsd_c,
      # rsd_s, each optionally NAME:SHAPE@L (see spec_jax.programs.evaluate.parse_method), and
      # the chains lookup (prompt lookup, no drafter model) and sd_lookup (lookup where the text
      # repeats, the drafter elsewhere).
      methods=("sd",),
      tree_width=3,      # K chains (specinfer/spectr), beam width W (rsd_s), root branching (rsd_c)
      tree_rule="auto",  # tree verification rule; auto = the one each tree's sampling needs
      gammas=_ints(args.gammas), temperatures=_floats(args.temperatures),
      batch_sizes=_ints(args.batch_sizes), num_prompts=args.num_prompts,
      new_tokens=args.new_tokens, max_prompt_tokens=96, top_k=0, top_p=1.0,
      rule="auto", lenience="lin", epsilon=1.0, stop_at_eos=False,
      relaxed_top_k=2,  # with rule='top_k_relaxed' (greedy, lossy): keep drafts in the top k
      epsilons=(),  # with rule='lenient': sweep these ε (one row each) instead of epsilon
      max_cache_len=8192,  # SmolLM2's context: prompt + new tokens + γ must fit
      save_text=False,     # True: every speculative run's continuations go to texts.jsonl
      # Every timed pass (autoregressive, drafter-only, speculative) runs each prompt batch this
      # many times and sums the per-batch medians: single passes vary by ±10-30% on a busy CPU.
      timing_repeats=1,
      # With BPD heads as the drafter (a train_bpd workdir): the refinements bpd_ngram[:P] and
      # bpd_neural (Kim et al. 2024). Each head's top_k candidates; bpd_ngram keeps the `paths`
      # best of the k^h lattice paths under (1 - w)·log q_head + w·log p_ngram (w =
      # ngram_weight; the n-gram is counted on `ngram`'s train split, or read from a .npz);
      # bpd_neural rescores each head's top k left to right with the `rescorer` LM (weight a =
      # rescorer_weight).
      bpd=dict(top_k=4, paths=16, ngram="spec_jax_shakespeare", ngram_order=4,
               ngram_weight=0.5,
               rescorer=common.model(size="drafter-s", checkpoint="runs/quickstart/drafter"),
               rescorer_weight=0.5),
      # Prompt lookup (methods lookup and sd_lookup): the text's last n tokens, n = max_ngram
      # down to 1, are looked up earlier in the text and what followed them is drafted;
      # sd_lookup takes that draft only for matches of min_ngram+ tokens, the drafter's
      # otherwise.
      lookup=dict(max_ngram=3, min_ngram=2))
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
