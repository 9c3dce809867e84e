"""The task suite: every method on Spec-Bench-style task categories (program: specbench_experiment).

  python launch.py --config experiments/specbench/config.py --workdir experiments/specbench
  python launch.py --config experiments/specbench/config.py:size=full \
      --workdir experiments/specbench_full                            # 80 × 256, batch 1 and 8
  python launch.py --config experiments/specbench/config.py:smoke --workdir /tmp/specbench
  python launch.py --config experiments/specbench/config.py --workdir experiments/specbench \
      --config.render_only=True   # report the runs that have finished, run nothing
  ... --config.bpd_checkpoint=runs/bpd_chat   # add the BPD heads' methods (bpd_methods; heads
      # of configs/train_bpd.py:data=sharegpt,vocab=8192)

Program: spec_jax/programs/specbench_experiment.py. The prompt sets are spec_jax/data/suite.py's
categories (`suite.categories`, all nine by default: chat, chat_turn2, code, translation,
summarization, math, qa, shakespeare, python), `suite.num_prompts` per category from
`suite.split`, drawn by `suite.seed`, each rendered with the verifier's chat template. First the
verifier answers chat_turn2's first turns (program generate, greedy, `turn1`); then one evaluate
run per category decodes its prompts with the autoregressive baseline and every entry of
`eval.methods` (sd with the drafter `drafter.checkpoint`, prompt lookup, SD under lookup, one RSD
tree; all at γ = 4) at every temperature of `eval.temperatures` and batch size of
`eval.batch_sizes`. With `bpd_checkpoint` set, one more evaluate run per category and
temperature decodes `bpd_methods` from those heads. Every run lives in <workdir>/runs/ and is
read back when finished, so a killed experiment resumes. Writes results.json, results.md (a
category × method table of τ and speedup, the published anchors beside it) and
tau_by_category.png.

Sizes (`:size=`): `cpu` (default) 16 prompts per category × 96 new tokens, batch 1; `full` 80 ×
256, batch 1 and 8, for a GPU. `:smoke`: tiny random models, 2 categories × 2 prompts, a few
tokens (tests; chat_turn2 builds the ShareGPT dataset on first use).
Needs the quickstart's feature drafter, distilled on ShareGPT (`runs/quickstart/drafter`:
python launch.py --config configs/quickstart.py --workdir runs/quickstart).
Time on 2 CPU cores, size=cpu: 6-12 min per category, ~80 min for the nine, where SmolLM2
decodes ~45 tokens/s alone (experiments/specbench/notes.md); 35-57 min per category, ~7 h for
the nine, where it decodes ~10. Per category and temperature there: the autoregressive baseline
~2.5 min, each method 3-5 min (the tree's the slowest: 15 tokens per verifier call), plus
compiling and the cost timings. Each category is its own run, read back once finished, so the
experiment can be run in pieces (`--config.suite.categories='("chat", "code")'`, then the rest
into the same workdir).
Timed passes include the prefill, which every method shares: speedups are of whole requests.
Reference numbers: experiments/specbench/results.md (the first command writes it).
GPU rows: experiments/specbench/gpu.sh (the drafter at 10× the main job's steps, then this
suite, on one lent GPU's 15 minutes; its header lists the calls).
"""

from configs import common
from configs import evaluate as evaluate_config
from configs import generate as generate_config
from spec_jax.data import suite

SIZES = {  # num_prompts per category, new tokens per prompt, batch sizes
    "cpu": (16, 96, (1,)),
    "full": (80, 256, (1, 8)),
}
# The default drafter: the quickstart's feature drafter (configs/quickstart.py, recipe sharegpt,
# trained into <its workdir>/drafter).
QUICKSTART_DRAFTER = "runs/quickstart/drafter"


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, size="cpu")
  if args.size not in SIZES:
    raise ValueError(f"size={args.size!r}: choose one of {sorted(SIZES)}.")
  num_prompts, new_tokens, batch_sizes = SIZES[args.size]
  config = evaluate_config.get_config("smoke" if args.smoke else None)
  config.program = "specbench_experiment"
  config.config_file = "experiments/specbench/config.py" + (f":{arg}" if arg else "")
  config.title = "Task suite: SmolLM2-135M-Instruct verifier, every method per category"
  config.render_only = False  # True: report the runs that have finished, run nothing
  config.note = ""  # free text under results.md's heading
  config.drafter_about = "the quickstart's feature drafter (`configs/quickstart.py`)"
  config.suite = dict(
      categories=suite.CATEGORIES,
      num_prompts=num_prompts,
      seed=0,
      split="test",
      # Each category's prompts are padded to its longest prompt rounded up to this many tokens
      # (eval.max_prompt_tokens of its run): categories of similar length share compiled shapes.
      prompt_multiple=64)
  # Every method at γ = 4 (the setting): the drafter alone, prompt lookup alone and
  # under the drafter, and one RSD tree (b = (2, 2, 1, 1): 14 draft nodes, 15 tokens per call).
  config.eval.update(methods=("sd", "lookup", "sd_lookup", "rsd_c:2-2@4"), gammas=(4,),
                     temperatures=(0.0, 1.0), batch_sizes=batch_sizes, num_prompts=num_prompts,
                     new_tokens=new_tokens, timing_repeats=1)
  if not args.smoke:
    config.drafter.checkpoint = QUICKSTART_DRAFTER
  # BPD heads (a train_bpd checkpoint): '' runs none; set, `bpd_methods` run from them too.
  config.bpd_checkpoint = ""
  config.bpd_methods = ("bpd_neural",)
  # chat_turn2's first answers: the verifier alone, greedy, up to new_tokens tokens each (the
  # program sets the model, tokenizer, prompts and prompt room from this config's fields).
  config.turn1 = generate_config.get_config(f"new_tokens={new_tokens}")
  config.turn1.chat = False  # the prompts file holds texts already in the chat template
  config.turn1.prompts = ()
  config.turn1.generation.batch_size = max(batch_sizes)
  if args.smoke:
    config.title = "Task suite (smoke: tiny random models)"
    config.drafter_about = "a random test-tiny drafter"
    config.suite.update(categories=("math", "chat_turn2"), num_prompts=2, prompt_multiple=512)
    # Two methods, greedy, one batch of both prompts: the test suite's time limit (every method
    # and temperature has its own tests; the report's tables per temperature are tested on
    # synthetic rows, the trees' cache room on the default config).
    config.eval.update(methods=("sd", "lookup"), gammas=(2,), temperatures=(0.0,),
                       num_prompts=2, new_tokens=8, batch_sizes=(2,))
    config.turn1 = generate_config.get_config("smoke")
    config.turn1.prompts = ()
    config.turn1.generation.update(max_new_tokens=6, batch_size=2)
  return config
