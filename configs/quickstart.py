"""The main job: SmolLM2 generation, the default drafter (a feature drafter built from the
verifier's last block, reading the verifier's final residual) distilled on ShareGPT chat with the
verifier's own answers, then AR vs SD with it on chat and code prompts, alone (sd) and under
prompt lookup (sd_lookup: decoding/drafters/lookup.py).

  python launch.py --config configs/quickstart.py --workdir runs/quickstart
  python launch.py --config configs/quickstart.py:recipe=shakespeare --workdir runs/quickstart_shakespeare
  python launch.py --config configs/quickstart.py:recipe=vinit --workdir runs/quickstart_vinit
  python launch.py --config configs/quickstart.py:recipe=scratch --workdir runs/quickstart_scratch
  python launch.py --config configs/quickstart.py:smoke --workdir /tmp/qs   # tiny, for tests

Recipes (`:recipe=`), each a sequence of drafter stages, every stage after the first starting
from the one before it:
  sharegpt (default)  `drafter`: a feature drafter (EAGLE; models/draft_init.py,
                   decoding/drafters/features.py): SmolLM2's block(s) `features_layers` with its
                   embedding, final norm and head, reading beside each token the verifier's final
                   residual one position back, with an output layer over the `vocab` most
                   frequent ShareGPT train tokens; distilled `sharegpt_steps` steps (JSD[0.5]
                   plus the feature regression) on ShareGPT train prompts (<= 128 tokens) with
                   the verifier's own answers (<= 128 tokens) sampled at `sharegpt_temp`: a pool
                   of `sharegpt_pool` batches of 8, generated once and cycled, whose verifier
                   hidden states the generation keeps (no teacher pass; configs/distill.py, recipe
                   `verifier`; experiments/specbench/notes.md compares the recipes);
  shakespeare      `drafter`: the same feature drafter distilled `features_steps` steps on
                   Shakespeare (rows of 16 + 112 tokens of the corpus, every position trained;
                   the vocabulary: Shakespeare's most frequent tokens);
  vinit            `drafter`: SmolLM2's blocks `vinit_layers` with its embedding, final norm and
                   head, distilled `vinit_steps` steps (JSD[0.5] on the corpus's own
                   continuations);
  scratch          `drafter`: drafter-s trained from scratch (`drafter_steps` steps of train_lm);
                   `distilled`: DistillSpec on a copy of it (`distill_steps` steps). The RSD,
                   DistillSpec, steering and BPD-rescorer experiments use its drafter
                   (`:recipe=scratch,vocab=0` into runs/quickstart_scratch, common.SCRATCH_DRAFTER);
then, for vinit and scratch unless `vocab=0`, `reduced`: the last stage's output layer cut to the
`vocab` most frequent Shakespeare tokens, distilled `vocab_steps` more steps.
The table: recipe sharegpt decodes `suite.categories` of the task suite (spec_jax/data/suite.py;
default chat = ShareGPT test first turns, and code = HumanEval; `:categories=chat+code+math`),
4 prompts × 48 new tokens each, drawn as experiments/specbench draws them; the Shakespeare
recipes decode 4 Shakespeare test prompts (`:categories=none`).
experiments/drafters/results.md measured every kind of drafter on Shakespeare;
experiments/specbench/notes.md the ShareGPT recipes.

Time, fresh workdir: see experiments/quickstart/notes.md (2 CPU cores: the ShareGPT dataset
build, the verifier's answers, the distillation and the table each timed) and
experiments/gpu/results.md (one H100). A second run reuses the dataset, the answers and the
trained drafters.
Output: runs/quickstart/log.txt (every log line; `--verbose` shows them on the console),
runs/quickstart/generate/generations.jsonl, one directory per stage (checkpoints,
metrics.jsonl, TensorBoard events, the verifier's answers in drafter/data_cache),
runs/quickstart/evaluate_<category>/ (evaluate_<stage>_<category>/ for later stages;
evaluate/ and evaluate_<stage>/ without categories: results.json, results.md, PNGs, the
prompts), runs/quickstart/quickstart.json.
"""

from configs import common
from configs import distill as distill_config
from configs import evaluate as evaluate_config
from configs import generate as generate_config
from configs import train_lm as train_lm_config

RECIPES = ("sharegpt", "shakespeare", "vinit", "scratch")
# γ of the table: the task suite's γ = 4 for the ShareGPT drafter (one γ keeps the main job
# short); the Shakespeare feature drafter's γ = 4 beside γ = 2 (its best measured speedups);
# γ = 2 for vinit (its best speedups in experiments/drafters); scratch keeps γ = 4.
GAMMAS = {"sharegpt": "4", "shakespeare": "2+4", "vinit": "2", "scratch": "4"}
# The table's task-suite categories per recipe ('none': evaluate's Shakespeare prompts).
CATEGORIES = {"sharegpt": "chat+code"}


def _categories(value: str) -> tuple[str, ...]:
  return () if value in ("", "none") else tuple(value.split("+"))


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, recipe="sharegpt", features_layers="29",
                          features_steps=500, features_passes=1, sharegpt_steps=400,
                          sharegpt_pool=64, sharegpt_temp=1.0, categories="",
                          vinit_layers="0+1+2+29", vinit_steps=150, vocab=8192, vocab_steps=20,
                          drafter_steps=300, distill_steps=30, distill_divergence="jsd",
                          distill_source="fixed")
  if args.recipe not in RECIPES:
    raise ValueError(f"recipe={args.recipe!r}: choose one of {RECIPES}.")
  config = common.base("quickstart")
  sub = "smoke" if args.smoke else None
  config.generate = generate_config.get_config(sub or "new_tokens=40")
  config.evaluate = evaluate_config.get_config(
      sub or f"gammas={GAMMAS[args.recipe]},temperatures=0+1,num_prompts=4,new_tokens=48")
  config.evaluate.title = "quickstart: SmolLM2-135M verifier, freshly built drafter"
  # Medians of 3 timed passes: one slow pass (±10-30% here) would set the table's baseline.
  config.evaluate.eval.timing_repeats = 1 if args.smoke else 3
  # The table's prompts: eval.num_prompts of each task-suite category (spec_jax/data/suite.py),
  # drawn by `seed` from `split` as experiments/specbench draws them, each padded to its longest
  # prompt rounded up to `prompt_multiple` tokens; no categories: evaluate's own prompts.
  categories = args.categories or ("math" if args.smoke else CATEGORIES.get(args.recipe, ""))
  config.suite = dict(categories=_categories(categories), seed=0, split="test",
                      prompt_multiple=512 if args.smoke else 64)
  if args.smoke:  # one γ, as the main job has (the suite's time; evaluate's tests sweep γ)
    config.evaluate.eval.gammas = (2,)
    # Every batch padded to the suite's width (512), one compiled program per setting instead of
    # one per bucket width: bucketing has its own tests (tests/test_prompt_buckets.py).
    config.evaluate.eval.prompt_buckets = 0
  else:  # and prompt lookup over the drafter (experiments/drafters/lookup: greedy τ 2.02 → 2.87)
    config.evaluate.eval.methods = ("sd", "sd_lookup")
  distill_args = (f"divergence={args.distill_divergence},source={args.distill_source}")
  features_size = f"smollm2-135m:layers={args.features_layers}:features=1" + (
      f":vocab={args.vocab}" if args.vocab else "")
  if args.smoke:
    # The scratch drafter, then a one-block, 64-token variant of it distilled from the verifier
    # (the code paths of both recipes, on tiny models).
    config.stages = ("drafter", "reduced")
    config.drafter = train_lm_config.get_config("smoke")
    config.reduced = distill_config.get_config("smoke,source=fixed")
    config.reduced.drafter.size = "test-tiny:layers=1:vocab=64"
    config.reduced.train.update(num_steps=4, eval_every=0, checkpoint_every=4)
  elif args.recipe == "sharegpt":
    # configs/distill.py's ShareGPT recipe `verifier` (rows of a chat prompt <= 128 tokens and
    # the verifier's answer <= 128 tokens) on a cycled pool, with the teacher cache.
    config.stages = ("drafter",)
    config.drafter = distill_config.get_config(
        f"data=sharegpt,divergence={args.distill_divergence},source=verifier,"
        f"temp={args.sharegpt_temp},steps={args.sharegpt_steps},size={features_size}")
    config.drafter.data.verifier_batches = args.sharegpt_pool
    config.drafter.distill.feature_passes = args.features_passes
    config.drafter.train.update(eval_every=0, checkpoint_every=50, log_every=10)
  elif args.recipe == "shakespeare":
    # The vocabulary is reduced from the start (no separate stage), and every position of a
    # row trains the drafter, so rows are 16 prompt + 112 response tokens.
    config.stages = ("drafter",)
    config.drafter = distill_config.get_config(
        f"{distill_args},steps={args.features_steps},lr=0.003,drafter=smollm2,"
        f"size={features_size}")
    config.drafter.data.update(prompt_tokens=16, response_tokens=112)
    config.drafter.distill.feature_passes = args.features_passes
    config.drafter.train.update(eval_every=0, checkpoint_every=50, log_every=10)
  elif args.recipe == "vinit":
    config.stages = ("drafter",)
    config.drafter = distill_config.get_config(
        f"{distill_args},steps={args.vinit_steps},lr=0.003,drafter=smollm2,"
        f"size=smollm2-135m:layers={args.vinit_layers}")
    config.drafter.train.update(eval_every=0, checkpoint_every=50, log_every=10)
  else:
    config.stages = ("drafter", "distilled")
    config.drafter = train_lm_config.get_config(
        f"size=drafter-s,steps={args.drafter_steps},batch=8,seq_len=128")
    config.drafter.train.update(eval_every=100, checkpoint_every=100, log_every=10)
    config.distilled = distill_config.get_config(f"{distill_args},steps={args.distill_steps}")
    config.distilled.train.update(checkpoint_every=10)
  if args.vocab and not args.smoke and args.recipe in ("vinit", "scratch"):
    config.stages += ("reduced",)
    config.reduced = distill_config.get_config(
        f"{distill_args},steps={args.vocab_steps},lr=0.003,size=drafter:vocab={args.vocab}")
    config.reduced.train.update(eval_every=0, checkpoint_every=args.vocab_steps, log_every=5)
  for stage in config.stages[1:]:
    # Set at run time to the previous stage's checkpoint.
    config[stage].drafter.checkpoint = ""
  for stage in config.stages:
    if config[stage].program == "distill":
      config[stage].eval.update(temperatures=(), at_start=False)  # evaluate measures τ
  return config
