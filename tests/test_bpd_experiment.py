"""The BPD experiment (experiments/bpd/config.py, program bpd_experiment) end to end on its smoke
config through launch.py: every method's rows, the report and plots; a rerun reads every
finished run back (nothing trains, decodes or analyses again); render_only runs nothing. Without
models: render_only of the committed results reproduces their rows, carried settings, the
report's arithmetic, and bad fields failing before anything runs."""

import json
import math
import os
import shutil

import pytest

from experiments.bpd import config as bpd_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNGS = ("tau_by_method.png", "oracle_vs_k.png", "entropy_repetition.png")
# The flags experiments/bpd/results.md was made with (experiments/bpd/notes.md).
COMMITTED = dict(carry=("spec_jax_shakespeare_h3", "spec_jax_shakespeare_h5",
                        "spec_jax_pystdlib_h3"),
                 carry_from=os.path.join(ROOT, "experiments/bpd/carried/results_7b1253b.json"))


def _refuse(*args, **kwargs):
  raise AssertionError("a finished piece was redone instead of read back")


def _run(config, workdir):
  """What launch.py does with a config: lock it (programs may not add fields), then run."""
  from spec_jax.programs import bpd_experiment
  config.lock()
  return bpd_experiment.run(config, workdir)


def test_bpd_experiment_smoke_resumes_and_renders(tmp_path, data_dir, monkeypatch, capsys):
  # Dispatched as launch.py does, in this process (it reuses the programs earlier tests
  # compiled), on the Shakespeare corpus the data_dir fixture prepared.
  monkeypatch.setenv("SPEC_JAX_DATA_DIR", data_dir)
  workdir = str(tmp_path / "bpd")
  _run(bpd_config.get_config("smoke"), workdir)
  assert "wrote results.json, results.md, tau_by_method.png" in capsys.readouterr().out

  rows = json.load(open(os.path.join(workdir, "results.json")))
  by = {}
  for r in rows:
    by.setdefault(r["method"], []).append(r)
  assert {"bpd", "bpd_tree", "bpd_ngram", "bpd_ngram_beam", "bpd_neural", "bpd_oracle"} <= set(by)
  assert sorted(r["p"] for r in by["bpd_ngram"]) == [4, 16]
  assert [r["p"] for r in by["bpd_ngram_beam"]] == [3]
  for r in rows:
    assert math.isfinite(r["block_efficiency"]) and r["block_efficiency"] >= 1.0
    assert r["dataset"] == "spec_jax_shakespeare" and r["heads"] == 2
    assert r["heads_data"] == "spec_jax_shakespeare" and r["heads_steps"] == 20
    if r["method"] not in ("autoregressive", "bpd_oracle"):  # the oracle decodes nothing
      assert r["identical_to_greedy"] is True and r["gamma"] == 2
  # Plain BPD: one call of every head per round, no drafter model; bpd_neural: its LM's h calls.
  assert all(r["drafter_calls_per_round"] == 1 for m in ("bpd", "bpd_tree") for r in by[m])
  assert by["bpd_neural"][0]["drafter_calls_per_round"] == 2
  assert by["bpd_neural"][0]["cost_ratio_c"] > 0 and by["bpd"][0]["cost_ratio_c"] == 0
  assert {r["verifier_tokens_per_call"] for r in by["bpd_ngram"]} == {1 + 2 * 4, 1 + 2 * 16}
  assert by["bpd_ngram_beam"][0]["verifier_tokens_per_call"] == 1 + 2 * 3
  oracle, = by["bpd_oracle"]
  assert set(oracle["oracle_tau"]) == {"1", "2", "4"} and len(oracle["head_entropy"]) == 2
  # The oracle at k = 1 replays greedy BPD on the evaluate run's prompts: the same τ.
  assert oracle["oracle_tau"]["1"] == pytest.approx(by["bpd"][0]["block_efficiency"], abs=1e-3)
  assert oracle["block_efficiency"] == oracle["oracle_tau"]["2"]  # the smoke's oracle_k
  md = open(os.path.join(workdir, "results.md")).read()
  for text in ("### spec_jax_shakespeare, T = 0", "## Paper numbers beside ours",
               "**Greedy in-domain τ ≥ 2**", "Kim et al. 2024", "**gain_over_bpd**",
               "bpd_ngram_beam W=3"):
    assert text in md
  for name in PNGS:
    assert os.path.getsize(os.path.join(workdir, name)) > 0

  # Resume in this process: every run is read back, the report comes out the same.
  from spec_jax.evaluation import bpd_analysis
  from spec_jax.programs import evaluate, train_bpd
  for module, name in ((train_bpd, "run"), (evaluate, "run"), (bpd_analysis, "analyse")):
    monkeypatch.setattr(module, name, _refuse)
  assert _run(bpd_config.get_config("smoke"), workdir) == rows
  assert open(os.path.join(workdir, "results.md")).read() == md

  # render_only: the finished runs as they are; an empty workdir gives empty tables.
  config = bpd_config.get_config("smoke")
  config.render_only = True
  assert _run(config, workdir) == rows
  config = bpd_config.get_config("smoke")
  config.render_only = True
  assert _run(config, str(tmp_path / "empty")) == []
  assert "_No run has finished._" in open(tmp_path / "empty" / "results.md").read()
  assert not os.path.exists(tmp_path / "empty" / "runs" / "heads_spec_jax_shakespeare_h2")

  # carry: a setting's rows read from an earlier results.json, nothing run for it (the heads
  # and run directories of `carried` do not exist), and results.md says so.
  carried = str(tmp_path / "carried")
  config = bpd_config.get_config("smoke")
  config.carry = ("spec_jax_shakespeare_h2",)
  config.carry_from = os.path.join(workdir, "results.json")
  got = _run(config, carried)
  assert [dict(r, carried=None) for r in got] == [dict(r, carried=None) for r in rows]
  assert all(r["carried"] for r in got) and not os.path.exists(os.path.join(carried, "runs"))
  assert "Carried, not rerun: the rows of spec_jax_shakespeare_h2" in open(
      os.path.join(carried, "results.md")).read()


def test_render_only_reproduces_the_committed_results(tmp_path):
  """experiments/bpd's results.json holds rows whose runs/ is not committed: render_only with the
  carry it was made with gives the same rows back (carried ones from carry_from, the others from
  the results.json itself) and names the runs it read there."""
  committed = json.load(open(os.path.join(ROOT, "experiments/bpd/results.json")))
  workdir = tmp_path / "bpd"
  workdir.mkdir()
  shutil.copy(os.path.join(ROOT, "experiments/bpd/results.json"), workdir)
  config = bpd_config.get_config()
  config.update(render_only=True, **COMMITTED)
  assert _run(config, str(workdir)) == committed
  md = (workdir / "results.md").read_text()
  assert ("Reported from the earlier results.json (render_only; their run directories are not "
          "in runs/): eval_spec_jax_pystdlib_h5_T0, eval_spec_jax_pystdlib_h5_T1, "
          "analysis_spec_jax_pystdlib_h5.") in md
  assert "**Greedy in-domain τ ≥ 2** (any decoded BPD method, T = 0): met in 4 of 4" in md
  assert ("| 5 | bpd_ngram_beam W=16 | lattice beam tree W=16 L=5 | 2.38 ± 0.21 | +74.0% ± 18.4"
          in md)
  for name in PNGS:
    assert os.path.getsize(workdir / name) > 10_000


def test_report_arithmetic_on_hand_rows():
  """The gain over plain bpd and its standard error, bpd_ngram's p, the oracle row at k, and the
  goals counted on them."""
  from spec_jax.evaluation import bpd_report
  base = dict(dataset="spec_jax_shakespeare", heads=3, temperature=0.0, heads_data=
              "spec_jax_shakespeare")
  rows = [dict(base, method="bpd", block_efficiency=1.5, tau_se=0.15),
          dict(base, method="bpd_ngram", block_efficiency=2.1, tau_se=0.21,
               tree="p=16 best lattice paths L=3"),
          dict(base, method="bpd_neural", block_efficiency=1.5, tau_se=None)]
  rows[1]["p"] = bpd_report.paths_kept(rows[1])
  assert rows[1]["p"] == 16 and bpd_report.paths_kept(dict(tree="lattice beam tree W=8")) == 8
  bpd_report.add_gains(rows)
  # 2.1 / 1.5 = 1.4, relative SE hypot(0.1, 0.1): 1.4 · 0.1414 = 0.198.
  assert rows[1]["gain_over_bpd"] == 0.4 and rows[1]["gain_se"] == pytest.approx(0.198, abs=1e-4)
  assert rows[2]["gain_over_bpd"] == 0.0 and "gain_over_bpd" not in rows[0]
  stats = dict(base, oracle_tau={"1": 1.5, "4": 2.5}, head_entropy=[1.0, 2.0, 3.0],
               repetition_rate=0.4, topk_accuracy={"1": [0.5] * 3}, prompts=8, tokens=64)
  oracle = bpd_report.oracle_row(4, stats)
  assert (oracle["method"], oracle["block_efficiency"], oracle["gamma"]) == ("bpd_oracle", 2.5, 3)
  assert oracle["new_tokens"] == 8 * 64 and oracle["heads_data"] == "spec_jax_shakespeare"
  config = bpd_config.get_config()
  config.update(datasets=("spec_jax_shakespeare",), heads=(3,), temperatures=(0.0,))
  goals = "\n".join(bpd_report.goal_lines(config, rows))
  assert "met in 1 of 1 in-domain settings" in goals and "τ 2.10 ± 0.21: τ ≥ 2 met" in goals
  # 0.4 / 0.198 > 2 standard errors: beyond noise.
  assert "bpd_ngram p=16 +40.0% ± 19.8 (above plain bpd beyond noise): ≥ +5% met" in goals
  config.goal_gain = 0.5
  assert "≥ +50% not met" in "\n".join(bpd_report.goal_lines(config, rows))


@pytest.mark.parametrize("field, value, message", [
    ("datasets", ("shakespeare",), "datasets has 'shakespeare'"),
    ("heads", (0,), "heads has 0"), ("heads", (), "heads is empty"),
    ("temperatures", (-1.0,), "temperatures has -1.0"),
    ("ngram_paths", (32,), "ngram_paths has 32"),
    ("top_k_per_heads", {"x2": 4}, "top_k_per_heads has 'x2'"),
    # k = 1 for h = 2 leaves one lattice path, fewer than the 4 and 16 bpd_ngram keeps.
    ("top_k_per_heads", {"h2": 1}, r"ngram_paths has 4, but h = 2 heads with a top-1"),
    ("oracle_k", 3, "gives k = 3 for h = 2, which is not in analysis_ks"),
    ("tree", "nope:2", "The evaluate run for spec_jax_shakespeare, h = 2, T = 0"),
    ("carry", ("spec_jax_shakespeare_h9",), "carry has 'spec_jax_shakespeare_h9', which is "
     "not one of this config's settings"),
    ("carry", ("spec_jax_shakespeare_h2",), r"takes rows from carry_from='', which is not a "
     "file")])
def test_bad_fields_fail_before_anything_runs(tmp_path, field, value, message):
  config = bpd_config.get_config("smoke")
  config[field] = value
  with pytest.raises(ValueError, match=message):
    _run(config, str(tmp_path / "bad"))
  assert not os.path.exists(tmp_path / "bad")


def test_lattice_k_per_head_count_and_the_oracle_at_the_decoded_k():
  from spec_jax.programs import bpd_experiment
  config = bpd_config.get_config()  # the full run: k = 16 for every h
  assert [bpd_experiment.lattice_k(config, h) for h in (3, 5)] == [16, 16]
  config.top_k_per_heads = {"h5": 8}
  assert [bpd_experiment.lattice_k(config, h) for h in (3, 5)] == [16, 8]
  assert [bpd_experiment.oracle_k(config, h) for h in (3, 5)] == [16, 8]
  assert {16, 8} <= set(config.analysis_ks)
  assert bpd_experiment.eval_config(config, "spec_jax_pystdlib", 5, 0.0, "x").eval.bpd.top_k == 8
  config.oracle_k = 4  # a fixed k for every h
  assert [bpd_experiment.oracle_k(config, h) for h in (3, 5)] == [4, 4]
  assert not bpd_config.get_config("top_k=8").top_k_per_heads


def test_heads_retrained_with_another_setting_are_decoded_and_analysed_again(tmp_path):
  """Heads trained by the experiment live in a folder named by dataset and h; retrained with
  another learning rate to the same step, the evaluate and analysis runs' inputs change with
  them (the newest step alone would not)."""
  from spec_jax.programs import bpd_experiment

  def plan(config):
    gen, runs = bpd_experiment.runs(config, str(tmp_path)), []
    run = next(gen)
    while True:
      runs.append(run)
      try:
        run = gen.send([])
      except StopIteration:
        return {r.name: r.inputs for r in runs if not r.name.startswith("heads_")}
  config = bpd_config.get_config("smoke")
  before = plan(config)
  config.train.train.lr = 10 * config.train.train.lr
  after = plan(config)
  assert before.keys() == after.keys() and before
  for name in before:
    assert before[name]["heads_run"] != after[name]["heads_run"], name


def test_an_evaluate_run_runs_again_for_new_methods_or_further_trained_heads(tmp_path):
  """A run's digest covers evaluate's methods and sweeps, and the heads are a path: the run's
  inputs name the heads' newest step, so either change makes the harness run it again."""
  from spec_jax.evaluation import experiment
  from spec_jax.programs import bpd_experiment
  heads = tmp_path / "heads"
  (heads / "checkpoints" / "10").mkdir(parents=True)
  config = bpd_config.get_config("smoke")

  def run():
    cfg = bpd_experiment.eval_config(config, "spec_jax_shakespeare", 2, 0.0, str(heads))
    return experiment.Run("eval", cfg, inputs=bpd_experiment.eval_inputs(cfg))
  before = run()
  config.ngram_beams = (3, 5)
  wider = run()
  assert experiment.run_digest(wider) != experiment.run_digest(before)
  assert list(wider.config.eval.methods) == [*before.config.eval.methods[:-1],
                                             "bpd_ngram_beam:5@2", "bpd_neural@2"]
  assert experiment.run_digest(run()) == experiment.run_digest(wider)  # same config: reused
  (heads / "checkpoints" / "20").mkdir()
  assert (before.inputs["heads_step"], run().inputs["heads_step"]) == (10, 20)
