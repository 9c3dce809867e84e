"""RSD experiment (Jeon et al. 2024 at small scale): draft trees vs chains on SmolLM2-135M.

  python launch.py --config experiments/rsd/config.py --workdir experiments/rsd   # full run
  python launch.py --config experiments/rsd/config.py:smoke --workdir /tmp/rsd    # tiny models
  python launch.py --config experiments/rsd/config.py --workdir experiments/rsd \
      --config.render_only=True   # report the runs that have finished, run nothing

Program: spec_jax/programs/rsd_experiment.py (one `evaluate` run per setting in
<workdir>/runs/, through the experiment harness: a finished run is read back, so a killed
experiment resumes). The finished runs' runs/*/results.json are committed (.gitignore keeps
them); they predate the runs' config.json, so render_only reports them and a full run does them
again (use another workdir for that). Writes results.json, results.md, level_acceptance.json,
tau_vs_depth.png and tau_vs_budget.png into the workdir.
Needs the scratch quickstart drafter (common.SCRATCH_DRAFTER, runs/quickstart_scratch/drafter).
Part (a), fixed draft length L ∈ {2, 3, 4}: SD (chain of L), SpecInfer and SpecTr (K = 3 i.i.d.
chains), RSD-C (b = (3, 1, ..., 1): three first tokens without replacement, then chains) and
RSD-S (beam width W = 3), temperature 1 and greedy (where SpecInfer/SpecTr reduce to SD and are
skipped), on Shakespeare and Python-code prompts. All tree methods then spend the same 3L + 1
verifier tokens per call. Part (b), fixed verifier budget B ∈ {6, 10, 14, 20, 30} tokens per call
at temperature 1, on both datasets: for each method the best of its candidate shapes with at
most B nodes (`budget_entries`: width 3 and 2, depth as deep as the budget allows; SD γ = B - 1),
stored in the config as `budget_methods["K{width}_B{budget}"]`; shapes part (a) already decoded
at the same temperature are read from its rows, not run again. Part (c), run first (minutes):
the chance that one tree level accepts one of k ∈ `level_ks` candidates under each rule
(SpecInfer, SpecTr's K-SEQ, RSD without replacement; evaluation/multidraft.py) on the verifier's
own T = 1 continuations of each dataset's prompts, which explains SpecTr against SpecInfer.
Every dataset's prompts are checked before anything runs. 48 prompts × 128 new tokens per
setting at batch 16, so that τ's standard error is ≤ ~0.03 (results.md states the largest).
Verdicts compare τ with its standard error: a difference counts beyond 2 standard errors.
Time on 2 CPU cores: several hours (~15 min per part-(a) setting of 5 methods); it resumes run
by run after a kill. GPU not measured. Smoke: tiny random models, Shakespeare only, ~80 s on 2
CPU cores (~20 s with a warm compilation cache).
Reference numbers: experiments/rsd/results.md; the run's history: experiments/rsd/notes.md.
"""

from configs import common
from configs import evaluate as evaluate_config
from configs import quickstart as quickstart_config


def budget_entries(budget: int, width: int) -> list[str]:
  """eval.methods entries (NAME:SHAPE@L) of the candidate trees of one width with at most
  `budget` nodes: the deepest tree of width K = W = `width` (RSD-C: b = (width, 1, ..., 1)),
  and the chain of γ = budget - 1 (SD has no width, it joins the first width's run)."""
  depth = (budget - 1) // width
  entries = [f"{m}:{width}@{depth}" for m in ("specinfer", "spectr", "rsd_s", "rsd_c")
             if depth >= 1]
  return entries


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False)
  config = evaluate_config.get_config("smoke" if args.smoke else None)
  config.drafter_about = ""  # how the drafter was trained, for results.md
  if not args.smoke:
    config.drafter.checkpoint = common.SCRATCH_DRAFTER
    recipe = "recipe=scratch,vocab=0"
    trained = quickstart_config.get_config(recipe).drafter
    config.drafter_about = (f"{trained.train.num_steps} steps of train_lm on "
                            f"{trained.data.name}: `configs/quickstart.py:{recipe}`")
  config.program = "rsd_experiment"
  # The --config argument that built this config: results.md names the command to rerun it.
  config.config_file = "experiments/rsd/config.py" + (f":{arg}" if arg else "")
  config.render_only = False  # True: report the runs that have finished, run nothing
  # Free text shown under results.md's heading: how the runs were made, where that matters.
  config.note = "" if args.smoke else (
      "The runs were made in several sessions, resuming from the finished runs' results.json "
      "(committed under runs/). A fresh checkout rebuilt the scratch drafter with "
      "its command (`configs/quickstart.py:recipe=scratch,vocab=0`); every run from "
      "fixed_budget_K3_B14 on Python code onwards used the rebuilt one. It is the same recipe "
      "but not bit-identical: part (c) on Python code gave per-level acceptance 0.0910 / 0.1208 "
      "/ 0.1406 (SpecInfer, k = 1, 2, 3) against the first drafter's 0.0911 / 0.1217 / 0.1418, "
      "differences far inside their standard errors (0.006-0.009).")
  config.title = "RSD: draft trees vs chains"
  config.datasets = ("spec_jax_shakespeare", "spec_jax_pystdlib")
  config.fixed_methods = ("sd", "specinfer", "spectr", "rsd_c", "rsd_s")
  # At T = 0 SpecInfer and SpecTr draw K copies of the drafter's greedy chain: they are SD.
  config.greedy_methods = ("sd", "rsd_c", "rsd_s")
  config.fixed_depths = (2, 3, 4)
  config.fixed_temperatures = (1.0, 0.0)
  config.budgets = (6, 10, 14, 20, 30)
  # One evaluate run per width; K = W = 3 first (its L = 3, 4 shapes are shared with part (a),
  # so they compile once), then K = W = 2.
  config.budget_widths = (3, 2)
  config.budget_temperature = 1.0
  config.budget_datasets = ("spec_jax_shakespeare", "spec_jax_pystdlib")
  # Sized for τ's standard error ≤ 0.03 at T = 1: a 16-prompt × 64-token pilot gave per-prompt
  # standard deviations of 0.21 (SD, L = 4) and 0.28 (RSD-C, L = 4) on Shakespeare; with 128
  # tokens, 64 prompts gave SE 0.015–0.018 at L = 2 (per-prompt sd ~0.14), so 48 prompts (three
  # full batches of 16) leave room for the deeper trees' larger spread.
  config.eval.update(tree_width=3, batch_sizes=(16,), num_prompts=48, new_tokens=128,
                     max_prompt_tokens=64)
  config.target_se = 0.03  # results.md compares the largest standard error of τ with it
  config.num_data_prompts = 48
  config.data_prompt_tokens = 48
  # Python code's test split has 46 documents: its prompts come from the train split (the
  # scratch drafter never saw Python; the comparison is between rules on the same prompts).
  config.prompt_splits = {"spec_jax_pystdlib": "train"}
  # Part (c): per-level acceptance of k candidates per rule (evaluation/multidraft.py) on the
  # verifier's own T = 1 continuations; RSD's is averaged over `level_draws` rejection paths.
  config.level_ks = (1, 2, 3)
  config.level_draws = 16
  if args.smoke:
    # Every code path (both parts, greedy and sampled) at the fewest shapes (one width, two
    # methods: the suite's time limit; every tree method has its own tests in
    # tests/test_tree_speculative.py, and the ordering check is tested on synthetic rows).
    config.fixed_methods = ("sd", "rsd_s")
    config.greedy_methods = ("sd", "rsd_s")
    config.datasets = ("spec_jax_shakespeare",)
    config.budget_datasets = ("spec_jax_shakespeare",)
    config.fixed_depths = (1,)
    config.budgets = (4,)
    config.budget_widths = (3,)
    config.eval.update(num_prompts=2, new_tokens=8, batch_sizes=(2,), max_prompt_tokens=32)
    config.num_data_prompts = 2
    config.data_prompt_tokens = 12
    config.level_ks = (1, 2)
    config.level_draws = 2
  # Part (b)'s eval.methods per run, as data (the program does not import this file): the
  # first width's runs also carry SD at γ = B - 1.
  config.budget_methods = {
      f"K{width}_B{budget}": tuple(([f"sd@{budget - 1}"] if i == 0 else [])
                                   + [e for e in budget_entries(budget, width)
                                      if e.split(":")[0] in config.fixed_methods])
      for i, width in enumerate(config.budget_widths) for budget in config.budgets}
  return config
