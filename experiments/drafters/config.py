"""Drafters that pay: the cost–acceptance frontier of drafters trained from scratch,
verifier-initialised drafters and reduced draft vocabularies, SmolLM2-135M verifier
(program: drafters_experiment).

  python launch.py --config experiments/drafters/config.py --workdir experiments/drafters
  python launch.py --config experiments/drafters/config.py:smoke --workdir /tmp/drafters  # tiny
  python launch.py --config experiments/drafters/config.py --workdir experiments/drafters \
      --config.render_only=True   # report the finished runs, run and time nothing

Program: spec_jax/programs/drafters_experiment.py. Every entry of `drafters` is built into
<workdir>/runs/train/<name> (a finished run is read back, an interrupted one resumes):
  * `scratch-*`: train_lm from scratch on Shakespeare for `scratch_steps` steps (the quickstart's
    recipe for drafter-s);
  * `vinit-*`: a subset of SmolLM2's own blocks (`model.size` options, models/draft_init.py) with
    its embedding, final norm and output head, distilled (JSD[0.5], fixed Shakespeare data,
    `distill_steps` steps);
  * `*-general`: as vinit, distilled on the general-domain dataset of the general_data program
    (self-instruct and corpus-continuation prompts answered by SmolLM2; built once, cached);
  * `features-*`: feature drafters (EAGLE; models/draft_init.py `features=1`): SmolLM2's last
    block(s) reading the verifier's final residual one position back beside each token, with an
    8192-token output layer, distilled on rows of `features_prompt_tokens` +
    `features_response_tokens` (every position trains them), their own `steps`;
  * `*-v4k/8k/16k`: the output layer of another entry (`base`: vinit-2/4, scratch-s) cut to the
    4096/8192/16384 most frequent tokens of Shakespeare's train split, then distilled
    `vocab_steps` more steps.
Then the evaluate program measures each drafter (chain SD at every γ of `gammas`, greedy and
T = 1, batch 1, beside the autoregressive baseline measured in the same process) on in-domain
prompts (Shakespeare, its test split) and out-of-domain ones (Python code) at `out_gammas`.
Writes results.json (rows: drafter, cost_ratio_c, gamma, temperature, domain, batch_size, rule,
block_efficiency, tau_se, speedup, theoretical_speedup, ...), results.md (the table, the frontier
and the goals checked) and frontier.png (τ against c) and speedup_vs_gamma.png.

Entries in `carry` take their rows from the results.json `carry_from` (an earlier run whose
trained drafters are gone), entries in `skip` are left out of this run; e.g. the run in results.md:
  --config.carry="('vinit-1','vinit-2','vinit-4','vinit-4-v8k','vinit-2-v8k','scratch-s',
      'scratch-s-v8k','vinit-4-general','vinit-4-general-v8k')" \
  --config.carry_from=experiments/drafters/carried/results_8dc556d.json \
  --config.skip="('vinit-4-v4k','vinit-4-v16k','scratch-xs','scratch-m')"
(with --config.render_only=True added, that command renders experiments/drafters/results.md
again from its committed rows: runs/ is not committed, so every run reports the rows
results.json holds for it).
Time on 2 CPU cores: each drafter's build time is in results.md's `build (s)` column (a feature
drafter step ~1.1 s on idle cores, 600 steps ~11 min); evaluation ~1 min per setting (8 per
drafter).
Reference numbers: experiments/drafters/results.md; analysis and follow-ups:
experiments/drafters/notes.md.
Smoke: tiny random models, byte tokenizer, seconds per stage.
"""

from configs import common
from configs import distill as distill_config
from configs import evaluate as evaluate_config
from configs import general_data as general_data_config
from configs import train_lm as train_lm_config


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, scratch_steps=300, distill_steps=150, vocab_steps=20,
                          num_prompts=8, new_tokens=48)
  config = common.base("drafters_experiment")
  del config["mesh"]  # each section keeps its own
  config.config_file = "experiments/drafters/config.py" + (f":{arg}" if arg else "")
  config.title = "Drafters that pay: cost against acceptance, SmolLM2-135M verifier"
  config.render_only = False
  # name -> how it is built: kind 'scratch' (train_lm, size), 'vinit' (distill from the
  # verifier's weights, size with its layer subset) or 'vocab' (distill from `base`'s trained
  # checkpoint with a reduced vocabulary of `vocab` tokens).
  config.drafters = dict(
      **{"vinit-1": dict(kind="vinit", size="smollm2-135m:layers=29"),
         "vinit-2": dict(kind="vinit", size="smollm2-135m:layers=0+29"),
         "vinit-4": dict(kind="vinit", size="smollm2-135m:layers=0+1+2+29")},
      **{f"vinit-4-v{n // 1024}k": dict(kind="vocab", base="vinit-4", vocab=n)
         for n in (4096, 8192, 16384)},
      **{f"scratch-{s}": dict(kind="scratch", size=f"drafter-{s}") for s in ("xs", "s", "m")},
      **{"scratch-s-v8k": dict(kind="vocab", base="scratch-s", vocab=8192),
         "vinit-2-v8k": dict(kind="vocab", base="vinit-2", vocab=8192)},
      # Distilled on the general-domain data (program general_data) instead of Shakespeare.
      **{"vinit-4-general": dict(kind="vinit", size="smollm2-135m:layers=0+1+2+29",
                                 data="general"),
         "vinit-4-general-v8k": dict(kind="vocab", base="vinit-4-general", vocab=8192)},
      # Feature drafters (EAGLE): SmolLM2's last block (or two) reading its final residual,
      # with a reduced vocabulary from the start.
      **{"features-1-v8k": dict(kind="features", steps=600,
                                size="smollm2-135m:layers=29:features=1:vocab=8192"),
         "features-1-v8k-long": dict(kind="features", steps=1500,
                                     size="smollm2-135m:layers=29:features=1:vocab=8192"),
         "features-2-v8k": dict(kind="features", steps=600,
                                size="smollm2-135m:layers=28+29:features=1:vocab=8192")})
  # Build-and-measure order (a ConfigDict lists its keys sorted): bases before their variants.
  config.order = (
      "vinit-1", "vinit-2", "vinit-4", "vinit-4-v8k", "vinit-2-v8k", "scratch-s",
      "scratch-s-v8k", "vinit-4-general", "vinit-4-general-v8k", "features-1-v8k",
      "features-1-v8k-long", "features-2-v8k", "vinit-4-v4k", "vinit-4-v16k", "scratch-xs", "scratch-m")
  # Entries whose rows come from an earlier results.json (their trained drafters are gone), e.g.
  # --config.carry="('vinit-1',)" --config.carry_from=experiments/drafters/carried/results_X.json
  config.carry = ()
  config.carry_from = ""
  # Entries neither built nor measured this run (listed empty in results.md).
  config.skip = ()
  # A feature drafter's distillation rows (every position trains it: mostly response).
  config.features_prompt_tokens = 16
  config.features_response_tokens = 112
  config.general = general_data_config.get_config("smoke" if args.smoke else None)
  config.scratch_steps = args.scratch_steps
  config.distill_steps = args.distill_steps
  config.vocab_steps = args.vocab_steps
  config.scratch = train_lm_config.get_config(
      "smoke" if args.smoke else "size=drafter-s,batch=8,seq_len=128")
  config.scratch.train.update(eval_every=0, checkpoint_every=100, log_every=10)
  config.distill = distill_config.get_config(
      "smoke,source=fixed" if args.smoke else "divergence=jsd,source=fixed,lr=0.003,drafter=")
  config.distill.eval.update(temperatures=(), at_start=False)  # τ comes from the evaluate runs
  config.distill.train.update(eval_every=0, checkpoint_every=50, log_every=10)
  config.eval = evaluate_config.get_config(
      "smoke" if args.smoke else
      f"gammas=2+4+6,temperatures=0+1,num_prompts={args.num_prompts},"
      f"new_tokens={args.new_tokens}")
  config.gammas = tuple(config.eval.eval.gammas)
  config.frontier_gamma = 4  # the γ of the frontier table, plot and goals
  # The goals, checked in results.md at frontier_gamma and the last temperature:
  # τ >= goal_tau_in on in-domain prompts, τ >= goal_tau_out out of domain.
  config.goal_tau_in = 2.0
  config.goal_tau_out = 1.5
  config.cost_repeats = 30   # turns of the c / r(γ + 1) timing (runs/costs.json)
  config.cost_timings = 1    # such timings, 15 s, 30 s, ... apart, the fastest kept
  config.out_gammas = (4,)   # out of domain: the goal's γ only (each γ costs a compile + passes)
  # results.json's `domain`: in (the training corpus) and out (another domain).
  config.domains = {"in": "spec_jax_shakespeare", "out": "spec_jax_pystdlib"}
  if args.smoke:
    # Every kind on tiny models: a drafter from scratch, one block of it distilled on the
    # general data (self-instruct only: no corpus to build), and its 64-token variant.
    config.drafters = dict(
        **{"scratch-t": dict(kind="scratch", size="test-tiny")},
        **{"vinit-1": dict(kind="vinit", size="test-tiny:layers=1", source="scratch-t",
                           data="general"),
           "vinit-1-v64": dict(kind="vocab", base="vinit-1", vocab=64)})
    config.order = ("scratch-t", "vinit-1", "vinit-1-v64")
    config.general.general.corpus_prompts = 0
    config.scratch_steps = config.distill_steps = config.vocab_steps = 2
    config.scratch.train.update(eval_every=0, checkpoint_every=2)
    config.distill.train.update(checkpoint_every=2)
    config.eval.eval.update(gammas=(2,), temperatures=(1.0,), num_prompts=2, new_tokens=8)
    config.gammas = (2,)
    config.out_gammas = (2,)
    config.frontier_gamma = 2
    config.cost_repeats = 3
  return config
