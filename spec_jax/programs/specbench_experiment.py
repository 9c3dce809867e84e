"""Program `specbench_experiment`: every method on the task suite's categories (Spec-Bench style).

  python launch.py --config experiments/specbench/config.py --workdir experiments/specbench

The prompts are spec_jax/data/suite.py's categories (`suite.categories`, `suite.num_prompts`
each, drawn by `suite.seed` from `suite.split`), rendered with the verifier's chat template.
Harness runs (evaluation/experiment.py: a finished run is read back, an interrupted experiment
resumes, `render_only` reports what has finished and runs nothing), in order:
1. `turn1_answers` (program generate; only with chat_turn2): the verifier's greedy answers to
   chat_turn2's first turns, which its second-turn prompts then hold (MT-bench's turn 2).
2. Per category, `eval_<category>` (program evaluate): the autoregressive baseline and every
   `eval.methods` entry at every `eval.temperatures` and `eval.batch_sizes`, on the category's
   prompts; with `bpd_checkpoint`, `eval_<category>_bpd_T<t>`: `bpd_methods` from those heads
   (each at the temperatures it takes).
A category's prompts go to a JSON-lines file in its run's directory, named by the digest of its
text (so a changed prompt set changes the run's config and is decoded again), and evaluate reads
them through `prompts_file`; its `eval.max_prompt_tokens` (the widest of the batches' bucket
widths, eval.prompt_buckets) is the longest prompt rounded up to `suite.prompt_multiple` tokens. Every category's prompts, and that they fit eval.max_cache_len
with the new tokens and the largest draft, are checked before any model loads.
Rows are evaluate's (bench.Row: τ, tau_se, per-position acceptance, tokens/s, speedup over the
same run's autoregressive pass, identical_to_greedy, ...) tagged `category`, `part`,
`max_new_tokens` (tokens per prompt) and `drafter_source` (lm or bpd). Writes results.json,
results.md and tau_by_category.png (evaluation/specbench_report.py).
"""

from __future__ import annotations

import copy
import os
from typing import Iterator

import ml_collections

from spec_jax.data import suite
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import methods as methods_lib
from spec_jax.evaluation import experiment, specbench_report
from spec_jax.programs import evaluate
from spec_jax.training import checkpoints

TURN1 = "turn1_answers"  # the generate run of chat_turn2's first answers
CACHE_FIELD = "eval.max_cache_len"


def eval_config(config, category: str, *, prompts_file: str = "", num_prompts: int | None = None,
                prompt_tokens: int | None = None, methods=None, temperatures=None,
                drafter: str | None = None) -> ml_collections.ConfigDict:
  """The evaluate config of one category's run: the experiment's evaluate fields
  (experiment.program_config) reading `prompts_file` alone, `num_prompts` of them padded to
  `prompt_tokens`, with `methods` at `temperatures` (default eval.methods, eval.temperatures)
  drafted from `drafter` (default drafter.checkpoint)."""
  cfg = experiment.program_config(config, "evaluate")
  cfg.prompts, cfg.prompts_file, cfg.num_data_prompts = (), prompts_file, 0
  if num_prompts is not None:
    cfg.eval.num_prompts = int(num_prompts)
  if prompt_tokens is not None:
    cfg.eval.max_prompt_tokens = int(prompt_tokens)
  if methods is not None:
    cfg.eval.methods = tuple(methods)
  if temperatures is not None:
    cfg.eval.temperatures = tuple(float(t) for t in temperatures)
  if drafter is not None:
    cfg.drafter.checkpoint = drafter
  cfg.title = f"{config.title}: {category}"
  return cfg


def turn1_config(config, prompts_file: str = "", prompt_tokens: int | None = None
                 ) -> ml_collections.ConfigDict:
  """The generate config of chat_turn2's first answers: config.turn1 with the experiment's
  verifier, tokenizer, seed, mesh and data dir, greedy, on `prompts_file` (chat texts)."""
  cfg = ml_collections.ConfigDict(config.turn1.to_dict())
  cfg.program = "generate"
  cfg.model = copy.deepcopy(config.verifier.to_dict())
  cfg.tokenizer, cfg.seed = config.tokenizer, config.seed
  cfg.mesh = copy.deepcopy(config.mesh.to_dict())
  cfg.data.data_dir = config.data.data_dir
  cfg.prompts, cfg.prompts_file, cfg.num_data_prompts, cfg.chat = (), prompts_file, 0, False
  cfg.method = "autoregressive"  # the verifier's own answer, as MT-bench's turn 1 is
  cfg.generation.sampling.update(temperature=0.0, top_k=0, top_p=1.0)
  if prompt_tokens is not None:
    cfg.generation.max_prompt_tokens = int(prompt_tokens)
  return cfg


def bpd_plan(config) -> list[tuple[float, tuple[str, ...]]]:
  """(temperature, bpd_methods it takes) per BPD run: greedy-only methods (no exact draft law)
  run at T = 0 alone. [] without bpd_checkpoint."""
  if not config.get("bpd_checkpoint", ""):
    return []
  out = []
  for t in config.eval.temperatures:
    names = tuple(m for m in config.bpd_methods if float(t) == 0.0 or not methods_lib.get(
        str(m).partition("@")[0].partition(":")[0], "bpd_methods").greedy_only)
    if names:
      out.append((float(t), names))
  return out


def eval_configs(config) -> list[ml_collections.ConfigDict]:
  """The evaluate configs every category runs (prompts aside): the main one, then BPD's."""
  return [eval_config(config, "check")] + [
      eval_config(config, "check", methods=names, temperatures=(t,),
                  drafter=config.bpd_checkpoint) for t, names in bpd_plan(config)]


def cache_extra(config) -> int:
  """Cache slots past a prompt: eval.new_tokens plus the largest draft's overhang (tree nodes
  − 1) over every run."""
  return int(config.eval.new_tokens) + max(
      [e.shape.num_nodes - 1 for c in eval_configs(config)
       for e in evaluate.method_runs(c.eval)], default=0)


def _check_fields(config) -> None:
  suite.check_categories(config.suite.categories)
  if len(set(config.suite.categories)) != len(config.suite.categories):
    raise ValueError(f"suite.categories={tuple(config.suite.categories)!r} names a category "
                     "twice. Fix: list each once.")
  for field in ("num_prompts", "prompt_multiple"):
    value = config.suite[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"suite.{field}={value!r} must be an integer >= 1.")


def prompt_sets(config, tokenizer) -> dict[str, list]:
  """category -> its prompts (chat messages; `suite.Turn2` pairs for chat_turn2), each set
  encoded once to check that it fits the cache (one error naming eval.max_cache_len)."""
  s, ev = config.suite, config.eval
  data_dir = config.data.data_dir or None
  extra = cache_extra(config)
  answer = int(config.turn1.generation.max_new_tokens)
  out = {}
  for category in s.categories:
    prompts = suite.category_prompts(category, s.num_prompts, seed=int(s.seed), split=s.split,
                                     data_dir=data_dir, tokenizer=tokenizer)
    if category == "chat_turn2":  # first turns + answers, then whole turn-2 prompts
      suite.encode_messages(tokenizer, [t.first_messages() for t in prompts],
                            cache_len=int(ev.max_cache_len), new_tokens=answer,
                            field=CACHE_FIELD, label="chat_turn2 first turn")
      suite.encode_messages(tokenizer, [t.messages("") for t in prompts],
                            cache_len=int(ev.max_cache_len), new_tokens=answer + extra,
                            field=CACHE_FIELD,
                            label=f"chat_turn2 prompt (with a {answer}-token first answer)")
    else:
      suite.encode_messages(tokenizer, prompts, cache_len=int(ev.max_cache_len),
                            new_tokens=extra, field=CACHE_FIELD, label=f"{category} prompt")
    out[category] = prompts
  return out


def check(config, workdir: str) -> None:
  """Bad input before any model loads: the suite fields, every evaluate config (methods,
  options, what each needs of its drafter checkpoint), then (not under render_only) every
  category's prompts and their cache room."""
  _check_fields(config)
  if config.render_only:
    return
  main, *bpd_runs = eval_configs(config)
  evaluate.check_config(main, workdir)
  for cfg in bpd_runs:  # the heads' runs: evaluate names its drafter field, this config's is ours
    try:
      evaluate.check_config(cfg, workdir)
    except (ValueError, FileNotFoundError) as e:
      raise (FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError)(
          f"bpd_checkpoint={config.bpd_checkpoint!r} (the BPD heads' evaluate runs, their "
          f"drafter.checkpoint): {e}") from None
  prompt_sets(config, tokenizer_lib.get_tokenizer(config.tokenizer))


def write_prompts(config, tokenizer, directory: str, messages, extra: int, label: str
                  ) -> tuple[str, int]:
  """(path, eval.max_prompt_tokens) of a prompt set written into `directory`
  (suite.write_prompt_file: rounded up to suite.prompt_multiple, `extra` cache slots after it)."""
  return suite.write_prompt_file(tokenizer, messages, directory,
                                 cache_len=int(config.eval.max_cache_len), new_tokens=extra,
                                 multiple=int(config.suite.prompt_multiple), field=CACHE_FIELD,
                                 label=label)


def runs(config, workdir: str) -> Iterator[experiment.Run]:
  """The generate run of chat_turn2's first answers, then each category's evaluate run(s)
  (module docstring). Under render_only no prompt is read: the runs keep placeholder configs
  (finished ones are read back whatever their config)."""
  render_only = bool(config.render_only)
  tokenizer = None if render_only else tokenizer_lib.get_tokenizer(config.tokenizer)
  sets = None if render_only else prompt_sets(config, tokenizer)
  extra = cache_extra(config)
  tags = dict(part=specbench_report.SUITE, max_new_tokens=int(config.eval.new_tokens))
  answers = None
  if "chat_turn2" in config.suite.categories:
    cfg = turn1_config(config)
    if sets is not None:
      path, room = write_prompts(
          config, tokenizer, os.path.join(workdir, "runs", TURN1),
          [t.first_messages() for t in sets["chat_turn2"]],
          int(config.turn1.generation.max_new_tokens), "chat_turn2 first turn")
      cfg = turn1_config(config, path, room)
    got = yield experiment.Run(TURN1, cfg, tags=dict(part=specbench_report.TURN1))
    if got and sets is not None:
      if len(got) != len(sets["chat_turn2"]):
        raise ValueError(f"{TURN1} holds {len(got)} answers for {len(sets['chat_turn2'])} "
                         f"prompts. Fix: delete {os.path.join(workdir, 'runs', TURN1)} and run "
                         "again.")
      answers = [r["completion"] for r in got]
  for category in config.suite.categories:
    name = f"eval_{category}"
    directory = os.path.join(workdir, "runs", name)
    prompts = None if sets is None else sets[category]
    if category == "chat_turn2":
      prompts = None if answers is None else [t.messages(a) for t, a in zip(prompts, answers)]
    written = {}
    if prompts is not None:
      path, room = write_prompts(config, tokenizer, directory, prompts, extra,
                                 f"{category} prompt")
      written = dict(prompts_file=path, num_prompts=len(prompts), prompt_tokens=room)
    lm = eval_config(config, category, **written)
    yield experiment.Run(name, lm, tags=dict(tags, category=category, drafter_source="lm"),
                         inputs=held(lm))
    for t, names in bpd_plan(config):
      heads = eval_config(config, category, methods=names, temperatures=(t,),
                          drafter=config.bpd_checkpoint, **written)
      yield experiment.Run(f"{name}_bpd_T{t:g}", heads, inputs=held(heads),
                           tags=dict(tags, category=category, drafter_source="bpd"))


def held(cfg) -> dict:
  """An evaluate run's inputs: what its drafter checkpoint holds (`checkpoints.identity`), so a
  drafter trained further at the same path (the quickstart's, BPD heads) is measured again."""
  ident = checkpoints.identity(cfg.drafter.checkpoint)
  return {"drafter": ident} if ident else {}


def run(config, workdir: str) -> list[dict]:
  return experiment.run_experiment(config, workdir, runs=runs, report=specbench_report.report,
                                   check=check)
