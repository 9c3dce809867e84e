"""The task-suite experiment (experiments/specbench/config.py + programs/specbench_experiment.py):
the smoke config end to end on tiny random models, its resume, bad input refused before any
model loads, and the report on synthetic rows.

ShareGPT comes from a small synthetic file in the package's format, built into a throwaway data
dir (the real one takes a while to build); math needs no data.
"""

import json
import os

import pytest

from experiments.dyn import config as dyn_config
from experiments.specbench import config as specbench_config
from spec_jax import loading, testing
from spec_jax.data import pipeline, sharegpt, suite
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.evaluation import experiment, specbench_report
from spec_jax.programs import evaluate, generate, specbench_experiment

FIELDS = ("category", "method", "temperature", "gamma", "block_efficiency", "tau_se",
          "per_position_acceptance", "tokens_per_s", "speedup", "identical_to_greedy",
          "num_prompts", "new_tokens", "max_new_tokens")


def _ids_in(split, n):
  out, i = [], 0
  while len(out) < n:
    if sharegpt.split_of_id(f"sb{i:03d}") == split:
      out.append(f"sb{i:03d}")
    i += 1
  return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  """A data dir with a synthetic ShareGPT: 4 test conversations of two user turns, and
  validation ones with a single user turn (so validation has no chat_turn2 prompt)."""
  path = tmp_path_factory.mktemp("specbench_data")
  records = [{"id": f"{base}_0", "conversations": [
      {"from": "human", "value": f"Tell me about topic number {k} in a few sentences"},
      {"from": "gpt", "value": "Topic."},
      {"from": "human", "value": f"Now shorten that to one line for topic {k}"},
      {"from": "gpt", "value": "Short."}]} for k, base in enumerate(_ids_in("test", 4))]
  records += [{"id": f"{base}_0", "conversations": [
      {"from": "human", "value": f"Write a short poem about item {k} please"},
      {"from": "gpt", "value": "A poem."}]} for k, base in enumerate(_ids_in("validation", 2))]
  source = path / "sharegpt.json"
  source.write_text(json.dumps(records))
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(sharegpt, "_source_json", lambda: source)
    pipeline._builder(sharegpt.NAME, str(path / "tfds"))  # built now, read later
  return str(path / "tfds")


def _smoke(root):
  config = specbench_config.get_config("smoke")
  config.data.data_dir = root
  return config


@pytest.fixture(scope="module")
def smoke(root, tmp_path_factory):
  """The smoke config (math and chat_turn2, 2 prompts each, tiny random models) run once."""
  workdir = str(tmp_path_factory.mktemp("specbench"))
  return workdir, testing.dispatch(_smoke(root), workdir)


def test_config_sizes():
  cpu, full = specbench_config.get_config(), specbench_config.get_config("size=full")
  assert (cpu.suite.num_prompts, cpu.eval.new_tokens, tuple(cpu.eval.batch_sizes)) == (16, 96, (1,))
  assert (full.suite.num_prompts, full.eval.new_tokens, tuple(full.eval.batch_sizes)) == (
      80, 256, (1, 8))
  assert tuple(cpu.suite.categories) == suite.CATEGORIES and cpu.eval.gammas == (4,)
  assert cpu.drafter.checkpoint == specbench_config.QUICKSTART_DRAFTER and not cpu.bpd_checkpoint
  assert cpu.program == "specbench_experiment" and cpu.verifier.checkpoint == "smollm2"
  with pytest.raises(ValueError, match="size='gpu'"):
    specbench_config.get_config("size=gpu")


def test_smoke_rows_carry_the_fields_and_greedy_rows_are_exact(smoke, root):
  workdir, rows = smoke
  config = _smoke(root)
  assert {r["category"] for r in rows} == {"math", "chat_turn2"}
  assert all(r["part"] == specbench_report.SUITE for r in rows)  # no generate rows
  assert {r["method"] for r in rows} == {"autoregressive", "sd", "lookup"}
  for r in rows:
    assert all(k in r for k in FIELDS), sorted(set(FIELDS) - set(r))
    assert r["num_prompts"] == 2 and r["max_new_tokens"] == config.eval.new_tokens
  assert {(r["temperature"], r["batch_size"]) for r in rows} == {(0.0, 2)}
  greedy = [r for r in rows if r["method"] != "autoregressive"]
  assert len(greedy) == 4 and all(r["identical_to_greedy"] is True for r in greedy)
  assert json.load(open(os.path.join(workdir, "results.json"))) == rows
  md = open(os.path.join(workdir, "results.md")).read()
  assert "## Batch 2, T = 0" in md and "| category | AR tokens/s | sd | lookup |" in md
  assert "| **mean** |" in md and "all 4 greedy speculative rows are identical" in md
  assert "EAGLE-3 paper (arXiv:2503.01840v3)" in md and "Not finished yet" not in md
  assert os.path.getsize(os.path.join(workdir, "tau_by_category.png")) > 0

  # The chat-template texts evaluate reads encode exactly as the suite encodes the messages.
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  saved = json.load(open(os.path.join(workdir, "runs", "eval_math", "config.json")))
  texts = [json.loads(line)["prompt"] for line in open(saved["prompts_file"])]
  messages = suite.category_prompts("math", 2, tokenizer=tokenizer)
  assert tokenizer.encode_batch(texts) == suite.encode_messages(tokenizer, messages,
                                                                cache_len=10**6)
  assert saved["eval"]["max_prompt_tokens"] == config.suite.prompt_multiple
  # chat_turn2: the verifier's greedy first answers are in the second-turn prompts.
  answers = json.load(open(os.path.join(workdir, "runs", specbench_experiment.TURN1,
                                        "results.json")))
  assert len(answers) == 2
  turn2 = json.load(open(os.path.join(workdir, "runs", "eval_chat_turn2", "config.json")))
  texts = [json.loads(line)["prompt"] for line in open(turn2["prompts_file"])]
  pairs = suite.category_prompts("chat_turn2", 2, data_dir=root)
  assert texts == [tokenizer_lib.chat_text(tokenizer, t.messages(a["completion"]))
                   for t, a in zip(pairs, answers)]


def test_smoke_resumes_without_decoding(smoke, root, monkeypatch):
  workdir, rows = smoke
  md = open(os.path.join(workdir, "results.md")).read()
  monkeypatch.setattr(evaluate, "run", testing.refuse)
  monkeypatch.setattr(generate, "run", testing.refuse)
  assert testing.dispatch(_smoke(root), workdir) == rows
  assert open(os.path.join(workdir, "results.md")).read() == md
  # render_only reads the same runs back without the prompts' data (no tokenizer, no dataset).
  monkeypatch.setattr(suite, "category_prompts", testing.refuse)
  config = _smoke(root)
  config.render_only = True
  assert testing.dispatch(config, workdir) == rows


def test_render_only_names_the_runs_not_finished(tmp_path, monkeypatch):
  monkeypatch.setattr(suite, "category_prompts", testing.refuse)
  config = specbench_config.get_config("smoke")
  config.render_only = True
  assert testing.dispatch(config, str(tmp_path)) == []
  md = open(tmp_path / "results.md").read()
  assert ("**Not finished yet: 3 runs** (turn1_answers, eval_math, eval_chat_turn2)") in md
  assert "No greedy rows yet." in md and not os.path.exists(tmp_path / "tau_by_category.png")


def test_run_digests_follow_the_prompts(tmp_path):
  """A run's digest moves with its prompts (the file is named by their digest), not with the
  experiment's own fields."""
  def digests(**suite_fields):
    config = specbench_config.get_config("smoke")
    config.suite.update(categories=("math",), **suite_fields)
    config.note = "another session"
    return {r.name: experiment.run_digest(r)
            for r in specbench_experiment.runs(config, str(tmp_path))}
  base = digests()
  assert list(base) == ["eval_math"] and digests() == base
  assert digests(seed=1) != base and digests(num_prompts=3) != base


def test_cache_room_and_bpd_runs_come_from_the_methods():
  config = specbench_config.get_config()
  # rsd_c:2-2@4 verifies 15 tokens per call: 14 slots past the committed ones, + 96 new tokens.
  assert specbench_experiment.cache_extra(config) == 14 + 96
  assert specbench_experiment.bpd_plan(config) == []
  config.bpd_checkpoint = "runs/bpd/heads"
  config.bpd_methods = ("bpd_neural", "bpd_ngram:4@3")
  # bpd_ngram keeps lattice paths with no exact law: greedy only.
  assert specbench_experiment.bpd_plan(config) == [(0.0, ("bpd_neural", "bpd_ngram:4@3")),
                                                   (1.0, ("bpd_neural",))]


def test_dyn_experiment_is_the_suite_on_chat_with_trees_at_equal_depth():
  config = dyn_config.get_config()
  assert config.program == "specbench_experiment" and tuple(config.suite.categories) == ("chat",)
  assert config.eval.methods == dyn_config.METHODS and config.eval.gammas == (4,)
  assert config.drafter.checkpoint == dyn_config.SHAREGPT_DRAFTER
  # dyn:8-64 verifies 65 tokens per call: 64 slots past the committed ones, + 96 new tokens.
  assert specbench_experiment.cache_extra(config) == 64 + 96
  smoke = dyn_config.get_config("smoke")
  assert smoke.eval.methods == ("sd", "dyn:2-4") and not smoke.drafter.checkpoint


@pytest.mark.parametrize("change, match", [
    (dict(categories=("chat", "nope")), "suite.categories=.*'nope' is not a category"),
    (dict(categories=("chat_turn2",), split="validation"),
     "suite.categories: category 'chat_turn2' has no prompts in split 'validation'"),
    (dict(num_prompts=0), "suite.num_prompts=0 must be an integer >= 1"),
    (dict(max_cache_len=40), "eval.max_cache_len=40 is too small"),
])
def test_bad_input_is_refused_before_any_model_loads(root, tmp_path, monkeypatch, change, match):
  monkeypatch.setattr(loading, "load_model", testing.refuse)
  config = _smoke(root)
  if "max_cache_len" in change:
    config.eval.max_cache_len = change.pop("max_cache_len")
  config.suite.update(change)
  with pytest.raises(ValueError, match=match):
    testing.dispatch(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")  # nothing ran


def _row(category, method, t, tau, speedup, se=0.1, identical=True, gamma=4, **kw):
  return dict(category=category, method=method, temperature=t, batch_size=1, gamma=gamma,
              block_efficiency=tau, tau_se=None if method == "autoregressive" else se,
              speedup=speedup, tokens_per_s=20.0 * speedup, num_prompts=16, new_tokens=1536,
              verifier_calls=1536 / tau,
              per_position_acceptance=None if method == "autoregressive" else [0.7, 0.5],
              identical_to_greedy=None if t or method == "autoregressive" else identical,
              part=specbench_report.SUITE, drafter_source="lm", verifier="smollm2",
              drafter="runs/quickstart/drafter", device="cpu", **kw)


def test_report_renders_table_mean_and_anchors_from_synthetic_rows(tmp_path):
  config = specbench_config.get_config()
  config.suite.categories = ("chat", "chat_turn2", "code", "math")
  rows = []
  for c, tau in (("chat", 2.0), ("chat_turn2", 3.0), ("code", 1.5), ("math", 2.5)):
    rows += [_row(c, "autoregressive", 0.0, 1.0, 1.0), _row(c, "sd", 0.0, tau, tau / 2),
             _row(c, "lookup", 0.0, tau - 0.5, 1.0, identical=c != "code")]
  rows.append(_row("math", "autoregressive", 1.0, 1.0, 1.0))
  rows.append(_row("math", "sd", 1.0, 1.8, 1.2, se=0.2))
  collected = experiment.Collected(rows=rows + [dict(part=specbench_report.TURN1)],
                                   missing=["eval_qa"], by_run={})
  out = specbench_report.report(config, collected, "python launch.py ...")
  assert out.rows == rows  # the generate run's rows stay out of results.json
  md = out.markdown
  assert "| category | AR tokens/s | sd | lookup |" in md
  assert "| chat_turn2 | 20.0 | 3.00 ± 0.10 · 1.50× | 2.50 ± 0.10 · 1.00× |" in md
  # Mean over 4 categories: τ (2 + 3 + 1.5 + 2.5) / 4 = 2.25, SE √(4 · 0.01) / 4 = 0.05.
  assert "| **mean** | | 2.25 ± 0.05 · 1.12× | 1.75 ± 0.05 · 1.00× |" in md
  assert "| math | 20.0 | 1.80 ± 0.20 · 1.20× | – |" in md  # T = 1: lookup not measured
  assert "| **mean** | | 1.80 ± 0.20 · 1.20× (1 of 1) |" not in md
  assert "**Exactness: 1 of 8 greedy rows differ" in md and "code/lookup/B=1" in md
  assert "**Not finished yet: 1 runs** (eval_qa)" in md
  # Anchors: the paper's per-task τ beside ours, every step pooled as theirs (MT-bench: chat's
  # 768 calls and chat_turn2's 512 for 2 × 1536 tokens, τ 2.40, not the mean 2.50).
  assert "| Vicuna-13B | EAGLE-3 | 6.65 | 7.54 | 6.29 |" in md
  assert "| smollm2-135m (ours) | sd | 2.40 | 1.50 | 2.50 |" in md
  assert "| Vicuna-13B-v1.3 | 5.71 | 4.43 | 2.39 | 2.19 | 1.67 |" in md
  # Spec-Bench's pooled mean: sd 6144 / (768 + 512 + 1024 + 614.4) = 2.11 (the table's mean of
  # the categories' τ is 2.25); lookup 6144 / 3942.4 = 1.56.
  assert "| smollm2-135m (ours) | – | – | – | 2.11 | 1.56 |" in md
  assert "- **math**: seeded, templated grade-school word problems" in md
  panels = specbench_report.plot_panels(config, rows)
  assert panels["T = 0, batch 1"]["sd"]["code"] == (1.5, 0.1)
  assert list(panels["T = 1, batch 1"]) == ["sd"]
  out.plots["tau_by_category.png"](str(tmp_path / "tau.png"))
  assert os.path.getsize(tmp_path / "tau.png") > 0
  # Without paired passes: no speedup chart, no paired terms in the glossary.
  assert list(out.plots) == ["tau_by_category.png"] and "paired_speedup" not in md


def test_report_names_shapes_of_one_method_and_sets_trees_beside_the_chain():
  config = specbench_config.get_config()
  config.suite.categories = ("chat",)
  config.eval.methods = ("sd", "dyn:4-16", "dyn:8-32")
  tree = dict(verifier_tokens_per_call=17, verifier_cost_ratio_r=1.9, cost_ratio_c=0.1,
              drafter_calls_per_round=4, call_widths=[1, 4, 4, 4], drafter_c=0.7,
              reference_vs_step=1.07, theoretical_speedup=1.2)
  rows = [_row("chat", "autoregressive", 0.0, 1.0, 1.0), _row("chat", "sd", 0.0, 2.0, 1.5),
          _row("chat", "dyn", 0.0, 3.0, 1.2, tree="dyn K=4 M=16 L=4", **tree),
          _row("chat", "dyn", 0.0, 3.3, 0.9, tree="dyn K=8 M=32 L=4",
               **dict(tree, verifier_tokens_per_call=33, verifier_cost_ratio_r=3.3))]
  md = specbench_report.report(
      config, experiment.Collected(rows=rows, missing=[], by_run={}), "cmd").markdown
  assert "| category | AR tokens/s | sd | dyn K=4 M=16 L=4 | dyn K=8 M=32 L=4 |" in md
  assert ("| chat | 20.0 | 2.00 ± 0.10 · 1.50× | 3.00 ± 0.10 · 1.20× | "
          "3.30 ± 0.10 · 0.90× |") in md
  # τ / τ(sd) = 1.5 and the measured speedup over sd's 1.2 / 1.5 = 0.8.
  # The drafter's calls with the tokens each feeds, their cost Σ_w c(w), and the verifier's
  # forward in the cost timings over the autoregressive step.
  assert ("| chat | dyn K=4 M=16 L=4 | 3.00 ± 0.10 · 1.20× | 1.50 | 17 | 1.90 | 0.10 | "
          "4 (1+4+4+4) | 0.70 | 1.07 | 1.20 | 0.80 |") in md
  assert "- **reference_vs_step**: " in md
  assert "| chat | dyn K=8 M=32 L=4 | 3.30 ± 0.10 · 0.90× | 1.65 | 33 | 3.30 |" in md
  assert "Exactness: all 3 greedy speculative rows" in md


def test_report_names_a_chain_by_its_depth_when_it_ran_at_several():
  """sd at γ = 4 and γ = 1 in one run (experiments/stop): a column each, and the anchors and the
  trees table still find the chain of the suite's depth."""
  config = specbench_config.get_config()
  config.suite.categories = ("chat",)
  config.eval.methods = ("sd", "sd@1", "rsd_c:2-2@4")
  rows = [_row("chat", "autoregressive", 0.0, 1.0, 1.0), _row("chat", "sd", 0.0, 2.0, 1.5),
          _row("chat", "sd", 0.0, 1.5, 1.1, gamma=1),
          _row("chat", "rsd_c", 0.0, 3.0, 1.2, tree="rsd_c b=2x2x1x1",
               verifier_tokens_per_call=15)]
  md = specbench_report.report(
      config, experiment.Collected(rows=rows, missing=[], by_run={}), "cmd").markdown
  assert "| category | AR tokens/s | sd@4 | sd@1 | rsd_c |" in md
  assert "| chat | rsd_c | 3.00 ± 0.10 · 1.20× | 1.50 |" in md   # τ over sd@4's
  assert "| smollm2-135m (ours) | – | – | – | 2.00 | – |" in md           # SpS: sd@4


def test_a_chain_of_the_lm_drafter_and_of_the_bpd_heads_keep_their_own_columns():
  """sd at two depths from the LM drafter and sd@4 from BPD heads: the heads' sd@4 gets its
  own column, not the LM drafter's."""
  rows = [dict(method="sd", gamma=4), dict(method="sd", gamma=1),
          dict(method="sd", gamma=4, drafter_source="bpd")]
  shaped = specbench_report.shaped_methods(rows)
  assert [specbench_report.method_key(r, shaped) for r in rows] == [
      "sd@4", "sd@1", "sd@4 (BPD heads)"]


def test_report_takes_paired_passes_as_the_speedup_and_says_which_are_resolved(tmp_path):
  """Rows with paired_speedups: the cell shows their median and range, the mean uses the
  median, a verdict line per method sorts the categories, and the speedup chart is drawn."""
  config = specbench_config.get_config()
  config.suite.categories = ("chat", "code", "math")
  rows = []
  for c, runs in (("chat", [1.02, 1.05, 1.10]), ("code", [0.95, 1.01, 1.03]),
                  ("math", [0.80, 0.85, 0.90])):
    rows += [_row(c, "autoregressive", 0.0, 1.0, 1.0),
             _row(c, "sd", 0.0, 1.5, 0.7, paired_speedup=runs[1], paired_speedups=runs)]
  rows += [_row("chat", "lookup", 0.0, 1.2, 1.1)]  # one pass only: as before
  out = specbench_report.report(config, experiment.Collected(rows=rows, missing=[], by_run={}),
                                "cmd")
  md = out.markdown
  assert "| chat | 20.0 | 1.50 ± 0.10 · 1.05× [1.02, 1.10] | 1.20 ± 0.10 · 1.10× |" in md
  assert "| math | 20.0 | 1.50 ± 0.10 · 0.85× [0.80, 0.90] | – |" in md
  # A range end that two decimals would print as 1.00 gets three: 0.998 is a slower pass.
  assert specbench_report._cell(1.5, 0.1, 0.98, (0.97, 0.998)) == (
      "1.50 ± 0.10 · 0.98× [0.97, 0.998]")
  assert specbench_report._cell(1.5, None, 1.0, (1.0, 1.02)) == "1.50 · 1.00× [1.00, 1.02]"
  assert "| **mean** | | 1.50 ± 0.06 · 0.97× |" in md  # (1.05 + 1.01 + 0.85) / 3
  assert ("- **sd** (3 paired passes per category): faster than autoregressive decoding in "
          "every pass in 1 of 3 categories (chat); slower in every pass in 1 (math); "
          "unresolved in 1 (code).") in md
  assert "lookup** (" not in md
  panels = specbench_report.speedup_panels(config, rows)
  assert list(panels["T = 0, batch 1"]) == ["sd"]
  mid, (down, up) = panels["T = 0, batch 1"]["sd"]["code"]
  assert (mid, round(down, 2), round(up, 2)) == (1.01, 0.06, 0.02)
  assert set(out.plots) == {"tau_by_category.png", "speedup_by_category.png"}
  out.plots["speedup_by_category.png"](str(tmp_path / "speed.png"))
  assert os.path.getsize(tmp_path / "speed.png") > 0 and "speedup_by_category.png" in md
  assert "- **paired_speedups**:" in md
