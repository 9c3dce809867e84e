"""DistillSpec experiment (Zhou et al. 2024 at small scale): which divergence and which data make
the best drafter for the SmolLM2-135M verifier, and what lossy decoding buys on top.

  python launch.py --config experiments/distillspec/config.py --workdir experiments/distillspec
  python launch.py --config experiments/distillspec/config.py:long \
      --workdir experiments/distillspec/long
  python launch.py --config experiments/distillspec/config.py:code \
      --workdir experiments/distillspec/code
  python launch.py --config experiments/distillspec/config.py:smoke \
      --workdir /tmp/distillspec   # tiny models, ~1 min on 2 CPU cores

Program: spec_jax/programs/distillspec_experiment.py (report: evaluation/distillspec_report.py).
The workdir gets results.json, results.md, tau_grid.png, lenience_tradeoff.png and
lenience_quality.png; every harness run (checkpoints in train/<name>, the verifier-response cache,
the decoding rows in eval/<run>) goes to `runs_dir` (runs/distillspec, runs/distillspec_long,
runs/distillspec_code; '' = <workdir>/runs, as in smoke). runs_dir is not committed: under
render_only a run it lacks takes its rows from the workdir's committed results.json.
Needs the scratch quickstart drafter (common.SCRATCH_DRAFTER, runs/quickstart_scratch/drafter:
drafter-s, 300 cross-entropy steps on Shakespeare). Every drafter starts from it and trains the
same `steps` steps (batch 8 × (32 prompt + 48 response) tokens, lr 1e-3, the `distill` program):
  * 16 distilled drafters: {FKL, RKL, JSD[0.5], TVD} × {fixed data, verifier-generated,
    on-policy (drafter-generated, refreshed every step), 50/50 on-policy + verifier mix};
  * the non-distilled baseline: the same steps of cross-entropy on the fixed data.
Each is evaluated on held-out Shakespeare test prompts (τ and α of chain SD at γ = 4, greedy and
temperature 1; speedup over autoregressive decoding measured in the same process and the
theoretical τ/(r(M)+γc) with c and r(M) measured), then the best distilled drafter and the
baseline run lenient decoding (f_lin, and f_exp for the best) over ε with its quality cost
(evaluation/quality.py).
Variants (`:key,...`): `long` trains 200 steps (the CE baseline and JSD[0.5] on fixed and on-policy
data; τ only), `code` runs the grid on Python code (spec_jax_pystdlib; fixed and on-policy data,
τ only), `steps=N` sets the budget, `smoke` is tiny. A killed run resumes where it stopped; with
`--config.render_only=True` the program reports what has finished and runs nothing.
`--config.note="..."` adds a line about the machine (its load) to results.md.
Time on 2 CPU cores: ~2.5 h for the grid (a distill step ~2.4 s on fixed data when the cores
are idle, up to ~5x slower when shared), ~8 min for its lenience sweep and batch-1 table; `long`
and `code` about an hour each. GPU: not measured.
Reference numbers: experiments/distillspec/results.md, long/results.md, code/results.md; the
dated runs and their analysis: experiments/distillspec/notes.md.
"""

import ml_collections

from configs import common
from configs import distill as distill_config


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, long=False, code=False, steps=0,
                          data="spec_jax_shakespeare")
  if args.code:
    args.data = "spec_jax_pystdlib"
  steps = args.steps or (200 if args.long else 40)
  config = ml_collections.ConfigDict()
  config.program = "distillspec_experiment"
  # The --config argument that built this config: results.md names the command to rerun it.
  config.config_file = "experiments/distillspec/config.py" + (f":{arg}" if arg else "")
  config.render_only = False  # True: report what has finished, train and evaluate nothing
  # Checkpoints, verifier responses and cached rows ('' = <workdir>/runs): one folder per
  # variant, since a resumed run reads back whatever a folder holds.
  config.runs_dir = "runs/distillspec" + "".join(
      suffix for on, suffix in ((args.long, "_long"), (args.code, "_code"),
                                (args.steps, f"_{args.steps}steps"),
                                (not args.code and args.data != "spec_jax_shakespeare",
                                 f"_{args.data}")) if on)
  config.title = "DistillSpec: distilled drafters for SmolLM2-135M-Instruct"
  config.note = ""  # free text for results.md, e.g. the machine's load while the timings ran
  # The distill program's config every run starts from; the sweep sets distill.divergence and
  # data.source. τ is measured by the experiment (more prompts, speedups), not by the program.
  base = distill_config.get_config(
      "smoke" if args.smoke else
      f"steps={steps},batch=8,data={args.data},drafter={common.SCRATCH_DRAFTER}")
  base.eval.update(temperatures=(), at_start=False)
  # Held-out metrics once, at the end; a checkpoint halfway so a killed sweep loses little.
  base.train.update(eval_every=base.train.num_steps,
                    checkpoint_every=max(base.train.num_steps // 2, 1))
  config.base = base
  config.divergences = ("fkl", "rkl", "jsd", "tvd")
  config.sources = ("fixed", "verifier", "onpolicy", "mix")
  config.beta = 0.5
  # The target the findings check: the best distilled drafter's τ ≥ (1 + goal) × the baseline's.
  config.goal = 0.15
  # τ and α over all prompts at batch 8; wall-clock speedups of the start, baseline and best
  # drafters at batch 1 too, where a γ+1-token verifier call costs about as much as a 1-token
  # one (docs/design.md §4): at batch 8 a CPU verifier call grows with the tokens it scores.
  config.eval = dict(num_prompts=16, prompt_tokens=32, new_tokens=48, batch_size=8, gamma=4,
                     temperatures=(0.0, 1.0), prompt_split="test", speedup_prompts=8,
                     speedup_batch_size=1)
  # Lossy decoding at T = 1: the best distilled drafter (f_lin and f_exp) and the baseline (f_lin).
  config.lenience = dict(temperature=1.0, lin_epsilons=(1.0, 0.5, 0.3, 0.1, 0.03),
                         exp_epsilons=(0.5, 0.3, 0.1))
  if args.long:  # τ only: no lenience sweep, no batch-1 timing
    config.title += f" (longer budget: {steps} steps)"
    config.divergences = ("jsd",)
    config.sources = ("fixed", "onpolicy")
    config.eval.speedup_prompts = 0
    config.lenience.update(lin_epsilons=(), exp_epsilons=())
  if args.code:  # the second task: Python code; no verifier generation, no timing
    config.title += " on Python code (the standard library)"
    config.sources = ("fixed", "onpolicy")
    config.eval.speedup_prompts = 0
    config.lenience.update(lin_epsilons=(), exp_epsilons=())
  if args.smoke:  # every code path (training, verifier cache, tables, plots) at the least cost
    config.runs_dir = ""
    config.divergences = ("fkl",)
    config.sources = ("mix",)  # the verifier cache and on-policy generation; fixed data is the
    # baseline's (and tests/test_distill.py's)
    base.data.refresh_every = 1
    base.train.update(num_steps=4, checkpoint_every=4, eval_every=4)
    # The batch-1 table at batch 2 too: the same shapes as the main pass, compiled once.
    config.eval.update(num_prompts=4, prompt_tokens=8, new_tokens=8, batch_size=2,
                       speedup_prompts=2, speedup_batch_size=2)
    config.lenience.update(lin_epsilons=(1.0, 0.3), exp_epsilons=(0.3,))
  return config
