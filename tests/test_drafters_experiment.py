"""The drafters experiment (scratch, verifier-initialised and reduced-vocabulary drafters, each
built and measured) end to end on its smoke config, and a rerun that runs nothing. Without
models: render_only of the committed results reproduces their rows, the cost arithmetic,
carried and skipped entries, and bad entries failing before anything runs."""

import json
import os
import shutil

import pytest

from experiments.drafters import config as drafters_config
from spec_jax.evaluation import drafters_report
from spec_jax.programs import drafters_experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _refuse(*args, **kwargs):
  raise AssertionError("a finished run was redone instead of read back")


@pytest.fixture(scope="module")
def smoke(data_dir, tmp_path_factory):
  config = drafters_config.get_config("smoke")
  for section in (config.scratch, config.distill, config.eval):
    section.data.data_dir = data_dir
  config.general.data_dir = data_dir
  workdir = str(tmp_path_factory.mktemp("drafters"))
  return config, workdir, drafters_experiment.run(config, workdir)


def test_every_drafter_is_built_and_measured(smoke):
  config, workdir, rows = smoke
  assert {r["drafter"] for r in rows} == set(config.drafters)
  assert all(r["rule"] in ("greedy", "speculative") and r["cost_ratio_c"] > 0 for r in rows)
  # c and r from the round-robin timing, the theory column recomputed from them.
  costs = json.load(open(os.path.join(workdir, "runs", "costs.json")))
  for r in rows:
    assert r["cost_ratio_c"] == costs["drafters"][r["drafter"]]["c"] and "cost_ratio_c_run" in r
    assert costs["drafters"][r["drafter"]]["passes"] >= 1  # forwards a timed call ran
    # config.cost_timings timings (the smoke's 1), the fastest verifier one-token forward's kept
    assert (costs["drafters"][r["drafter"]]["timings"],
            costs["drafters"][r["drafter"]]["reference_spread"]) == (config.cost_timings, 1.0)
    assert r["theoretical_speedup"] == pytest.approx(r["block_efficiency"] / (
        r["verifier_cost_ratio_r"] + r["gamma"] * r["cost_ratio_c"]), rel=1e-3)
    assert r["params_m"] > 0 and r["build_s"] > 0
  keys = ("drafter", "cost_ratio_c", "gamma", "temperature", "domain", "batch_size", "rule",
          "block_efficiency", "speedup", "theoretical_speedup")
  saved = json.load(open(os.path.join(workdir, "results.json")))
  assert saved == rows and all(k in r for r in saved for k in keys)
  md = open(os.path.join(workdir, "results.md")).read()
  assert "## The frontier at γ = 2" in md and "vinit-1-v64" in md
  for png in ("frontier.png", "speedup_vs_gamma.png"):
    assert os.path.getsize(os.path.join(workdir, png)) > 10_000
  # The verifier-initialised drafter keeps one block of its source, trained on the
  # general_data program's dataset; its variant 64 tokens of its vocabulary, counted there.
  from spec_jax.training import checkpoints  # noqa: PLC0415
  general = json.load(open(os.path.join(workdir, "runs", "general_data", "general_data.json")))
  assert general["dataset"].startswith("spec_jax_general/") and general["splits"]["train"] > 0
  vinit = checkpoints.read_meta(os.path.join(workdir, "runs", "train", "vinit-1"))
  reduced = checkpoints.read_meta(os.path.join(workdir, "runs", "train", "vinit-1-v64"))
  assert vinit["config"]["data"]["name"] == general["dataset"] == reduced["config"]["data"]["name"]
  assert vinit["model"]["n_layers"] == reduced["model"]["n_layers"] == 1
  assert not vinit["model"]["head_ids"] and len(reduced["model"]["head_ids"]) == 64


def test_a_rerun_reads_everything_back(smoke, monkeypatch):
  """Nothing is built, measured or timed again: the same rows, with and without render_only."""
  config, workdir, rows = smoke
  from spec_jax.evaluation import timing
  from spec_jax.programs import distill, evaluate, general_data, train_lm
  for module, name in ((train_lm, "run"), (distill, "run"), (evaluate, "run"),
                       (general_data, "run"), (timing, "round_robin")):
    monkeypatch.setattr(module, name, _refuse)
  stamps = {n: os.path.getmtime(os.path.join(workdir, "runs", "train", n, "results.json"))
            for n in config.drafters}
  assert drafters_experiment.run(config, workdir) == rows
  config.render_only = True
  assert drafters_experiment.run(config, workdir) == rows
  assert stamps == {n: os.path.getmtime(os.path.join(workdir, "runs", "train", n, "results.json"))
                    for n in config.drafters}


def test_carried_and_skipped_entries_are_neither_built_nor_measured(smoke, tmp_path):
  """Entries in `carry` take their rows from an earlier results.json, entries in `skip` are left
  out; nothing is built or timed for either, and results.md names the carried ones."""
  config, workdir, rows = smoke
  config = drafters_config.get_config("smoke")
  config.update(carry=("scratch-t", "vinit-1"), skip=("vinit-1-v64",),
                carry_from=os.path.join(workdir, "results.json"))
  got = drafters_experiment.run(config, str(tmp_path))
  assert got == [dict(r, carried=True) for r in rows if r["drafter"] in ("scratch-t", "vinit-1")]
  assert not os.path.exists(tmp_path / "runs" / "train")
  assert "Rows of scratch-t, vinit-1 are carried from" in (tmp_path / "results.md").read_text()


def test_render_only_reproduces_the_committed_results(tmp_path):
  """experiments/drafters' results.json holds rows whose runs/ is not committed: render_only with
  the carry and skip it was made with gives the same rows back (the carried ones marked so) and
  names the runs whose rows it read there."""
  committed = json.load(open(os.path.join(ROOT, "experiments/drafters/results.json")))
  workdir = tmp_path / "drafters"
  workdir.mkdir()
  shutil.copy(os.path.join(ROOT, "experiments/drafters/results.json"), workdir)
  config = drafters_config.get_config()
  carry = ("vinit-1", "vinit-2", "vinit-4", "vinit-4-v8k", "vinit-2-v8k", "scratch-s",
           "scratch-s-v8k", "vinit-4-general", "vinit-4-general-v8k")
  config.update(render_only=True, carry=carry,
                skip=("vinit-4-v4k", "vinit-4-v16k", "scratch-xs", "scratch-m"),
                carry_from=os.path.join(ROOT, "experiments/drafters/carried/results_8dc556d.json"))
  got = drafters_experiment.run(config, str(workdir))
  assert [dict(r, carried=None) for r in got] == [dict(r, carried=None) for r in committed]
  assert [bool(r.get("carried")) for r in got] == [r["drafter"] in carry for r in got]
  md = (workdir / "results.md").read_text()
  assert "are not in runs/): eval_features-1-v8k_in, eval_features-1-v8k_out," in md
  assert ("| features-1-v8k-long | 37.23 | 1890 | 0.073 | 2.33 ± 0.19 | 2.00 ± 0.08 | "
          "1.20 ± 0.05 | 1.81 | 1.67 | 1.29 |") in md
  assert ("features-1-v8k-long: τ(γ=4, T=1, in) 2.00 ± 0.08 (goal ≥ 2.0: met, within 2 SE); out "
          "of domain 1.20 ± 0.05 (goal ≥ 1.5: not met)") in md
  assert "| vinit-4-v4k | – | – | – | – | – | – | – | – | – |" in md
  assert "(28.3M for smollm2's)" in md


def test_costs_replace_the_in_run_c_and_r():
  """with_costs: c and r(γ + 1) from the timing, theory = τ / (r + γ·c), the in-run ones kept
  as *_run; a drafter the timing has not measured keeps its own."""
  rows = [dict(drafter="a", gamma=4, block_efficiency=2.0, cost_ratio_c=0.5,
               verifier_cost_ratio_r=1.5, theoretical_speedup=0.57),
          dict(drafter="b", gamma=4, block_efficiency=2.0, cost_ratio_c=0.5,
               verifier_cost_ratio_r=1.5, theoretical_speedup=0.57)]
  got = drafters_report.with_costs(rows, {"drafters": {"a": {"c": 0.1, "r": {"4": 1.2}}}})
  assert got[0]["cost_ratio_c"] == 0.1 and got[0]["verifier_cost_ratio_r"] == 1.2
  assert got[0]["theoretical_speedup"] == pytest.approx(2.0 / (1.2 + 4 * 0.1), abs=1e-4)
  assert (got[0]["cost_ratio_c_run"], got[0]["verifier_cost_ratio_r_run"],
          got[0]["theoretical_speedup_run"]) == (0.5, 1.5, 0.57)
  assert got[1] == rows[1] and "cost_ratio_c_run" not in rows[0]


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(carry=("scratch-t",), carry_from="x.json"),
     "drafters.vinit-1 starts from 'scratch-t', which is carried"),
    (lambda c: c.update(skip=("vinit-1",)), "drafters.vinit-1-v64 starts from 'vinit-1', which "
                                           "is skipped"),
    (lambda c: c.update(carry=("nope",)), r"carry / skip list \['nope'\]"),
    (lambda c: c.update(carry=("scratch-t", "vinit-1", "vinit-1-v64"), carry_from="none.json"),
     "takes rows from carry_from='none.json', which is not a file"),
    (lambda c: c.drafters["vinit-1"].update(kind="magic"), "kind='magic'"),
    (lambda c: c.drafters["vinit-1-v64"].update(base="nope"), "needs base=<another entry>"),
    (lambda c: setattr(c, "order", ("scratch-t", "vinit-1-v64", "vinit-1")),
     "'vinit-1' must come before 'vinit-1-v64'"),
    (lambda c: setattr(c, "order", ("vinit-1",)), "must list every entry"),
    (lambda c: c.eval.eval.update(batch_sizes=(1, 4)),
     r"eval.eval.batch_sizes=\(1, 4\): the drafters' frontier compares them at one batch size"),
    (lambda c: setattr(c, "cost_timings", 0), r"cost_timings=0 must be an integer >= 1"),
])
def test_bad_entries_are_named_before_anything_runs(tmp_path, change, message):
  config = drafters_config.get_config("smoke")
  change(config)
  with pytest.raises(ValueError, match=message):
    drafters_experiment.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")


def test_a_drafter_built_from_another_is_rebuilt_when_that_one_changes(tmp_path):
  """vinit-1 starts from scratch-t's checkpoint and vinit-1-v64 from vinit-1's, both read by
  path: each build's inputs name the identity of the build it starts from, so a change to
  scratch-t reaches both (and, through eval_inputs, their evaluations)."""
  from spec_jax.evaluation import experiment
  config = drafters_config.get_config("smoke")
  assert config.drafters["vinit-1"]["source"] == "scratch-t"
  assert config.drafters["vinit-1-v64"]["base"] == "vinit-1"

  def builds():
    built, out = {}, {}
    for name in ("scratch-t", "vinit-1", "vinit-1-v64"):
      cfg, _ = drafters_experiment.build_config(config, str(tmp_path), name, "")
      out[name] = experiment.Run(name, cfg,
                                 inputs=drafters_experiment.build_inputs(config, name, built))
      built[name] = experiment.identity(out[name])
    return out
  before = builds()
  assert before["scratch-t"].inputs == {}
  config.drafters["scratch-t"]["size"] = "drafter-t:layers=1"
  after = builds()
  assert experiment.run_digest(after["vinit-1"]) == experiment.run_digest(before["vinit-1"])
  for name in ("vinit-1", "vinit-1-v64"):
    assert after[name].inputs != before[name].inputs, name
    assert (drafters_experiment.eval_inputs(None, after[name])
            != drafters_experiment.eval_inputs(None, before[name]))


def test_an_evaluate_run_runs_again_for_a_rebuilt_drafter_or_a_new_gamma(tmp_path):
  """The drafter is a path: the run's inputs name the build's digest; a new γ changes the run's
  own digest (it covers evaluate's sweeps). Either change makes the harness run it again."""
  from spec_jax.evaluation import experiment
  config = drafters_config.get_config("smoke")

  def run():
    cfg, train_fn = drafters_experiment.build_config(config, str(tmp_path), "scratch-t", "")
    build = experiment.Run("train_scratch-t", cfg, fn=train_fn)
    eval_cfg = drafters_experiment.eval_config(config, str(tmp_path), "scratch-t", "in")
    return experiment.Run("eval", eval_cfg,
                          inputs=drafters_experiment.eval_inputs(eval_cfg, build))
  before = run()
  config.scratch_steps = 3
  longer = run()
  assert longer.inputs["drafter"] != before.inputs["drafter"]
  assert experiment.run_digest(longer) == experiment.run_digest(before)
  config.gammas = (2, 3)
  wider = run()
  assert wider.inputs == longer.inputs
  assert experiment.run_digest(wider) != experiment.run_digest(longer)
