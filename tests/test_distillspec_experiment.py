"""The DistillSpec experiment (experiments/distillspec/config.py + distillspec_experiment): one
end-to-end smoke whose rerun reads every run back, and the rest (configs, checks, the report,
render_only from a results.json, the stale-checkpoint guard) without models."""

import copy
import json
import os
import shutil

import pytest

from experiments.distillspec import config as distillspec_config
from spec_jax import testing


def _refuse_everything(monkeypatch):
  """No training, decoding, timing or model loading may happen."""
  from spec_jax import loading
  from spec_jax.evaluation import bench
  from spec_jax.programs import distill
  monkeypatch.setattr(distill, "run", testing.refuse)
  monkeypatch.setattr(loading, "load_model", testing.refuse)
  for name in ("autoregressive", "speculative", "drafter_cost", "verifier_cost_ratio"):
    monkeypatch.setattr(bench, name, testing.refuse)


def _part(rows, part):
  return [r for r in rows if r["part"] == part]


@pytest.fixture(scope="module")
def distillspec_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("distillspec"))
  testing.dispatch(distillspec_config.get_config("smoke"), workdir)
  return workdir


def test_distillspec_configs_cover_the_grid_and_the_longer_budget():
  grid = distillspec_config.get_config()
  assert grid.program == "distillspec_experiment" and grid.runs_dir == "runs/distillspec"
  assert (grid.divergences, grid.sources) == (("fkl", "rkl", "jsd", "tvd"),
                                              ("fixed", "verifier", "onpolicy", "mix"))
  assert grid.base.train.num_steps == 40 and grid.base.train.checkpoint_every == 20
  long = distillspec_config.get_config("long")
  assert long.base.train.num_steps == 200 and long.eval.speedup_prompts == 0
  assert not long.lenience.lin_epsilons and long.divergences == ("jsd",)
  assert long.runs_dir == "runs/distillspec_long"
  assert distillspec_config.get_config("long,steps=80").base.train.num_steps == 80
  code = distillspec_config.get_config("code")
  assert code.base.data.name == "spec_jax_pystdlib" and code.runs_dir == "runs/distillspec_code"
  smoke = distillspec_config.get_config("smoke")
  assert smoke.base.verifier.size == "test-tiny" and smoke.base.train.num_steps == 4
  assert smoke.runs_dir == ""  # <workdir>/runs


def test_distillspec_smoke_writes_results_and_resumes(distillspec_workdir, monkeypatch):
  config = distillspec_config.get_config("smoke")
  workdir = distillspec_workdir
  for name in ("results.md", "tau_grid.png", "lenience_tradeoff.png", "lenience_quality.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  assert sorted(os.listdir(os.path.join(workdir, "runs", "train"))) == ["baseline", "fkl_mix"]
  assert os.listdir(os.path.join(workdir, "runs", "verifier_cache"))  # the mix's responses
  results = json.load(open(os.path.join(workdir, "results.json")))
  assert {r["drafter"] for r in _part(results, "train")} == {"baseline", "fkl_mix"}
  grid = _part(results, "grid")
  assert {(r["drafter"], r["temperature"]) for r in grid} == {
      (n, t) for n in ("baseline", "fkl_mix") for t in (0.0, 1.0)}
  for r in grid:
    assert r["method"] == "sd" and r["gamma"] == config.eval.gamma
    assert 1.0 <= r["block_efficiency"] <= config.eval.gamma + 1
    assert 0.0 <= r["acceptance_rate"] <= 1.0 and r["tau_se"] >= 0 and r["token_tv"] == 0
  # The theoretical speedup is τ / (r(M) + γc) with the measured r(M), in every part.
  for r in grid + _part(results, "lenience") + _part(results, "speedup"):
    r_m, c = r["verifier_cost_ratio_r"], r["cost_ratio_c"]
    assert r_m > 0 and c > 0
    assert r["theoretical_speedup"] == pytest.approx(
        r["block_efficiency"] / (r_m + r["gamma"] * c), rel=2e-3)
  # Lenience: f_lin over ε for the best distilled drafter and the baseline, f_exp for the best.
  lenient = _part(results, "lenience")
  assert {(r["lenience"], r["epsilon"]) for r in lenient} == {("lin", 1.0), ("lin", 0.3),
                                                              ("exp", 0.3)}
  assert {r["drafter"] for r in lenient} == {"baseline", "fkl_mix"}
  assert all(r["token_tv"] > 0 for r in lenient if r["epsilon"] < 1)
  speedup = _part(results, "speedup")
  assert speedup and {r["drafter"] for r in speedup} <= {"baseline", "fkl_mix"}
  assert {r["batch_size"] for r in speedup} == {config.eval.speedup_batch_size}
  md = open(os.path.join(workdir, "results.md")).read()
  assert (f"Produced by `python launch.py --config experiments/distillspec/config.py:smoke "
          f"--workdir {workdir}`") in md
  assert "## Findings (computed from the numbers above)" in md and "CE baseline" in md
  assert "carry no measured r(M)" not in md and "Not finished" not in md

  # Resume: no drafter is trained, no model loaded and no row decoded again; the same results.
  _refuse_everything(monkeypatch)
  again = testing.dispatch(distillspec_config.get_config("smoke"), workdir)
  assert again == results == json.load(open(os.path.join(workdir, "results.json")))
  assert open(os.path.join(workdir, "results.md")).read() == md


def test_distillspec_render_only_runs_nothing(tmp_path, monkeypatch):
  _refuse_everything(monkeypatch)
  config = distillspec_config.get_config("smoke")
  config.render_only = True
  assert testing.dispatch(config, str(tmp_path)) == []
  md = open(tmp_path / "results.md").read()
  assert "Not finished yet" in md and "train_baseline" in md
  assert not os.path.exists(tmp_path / "tau_grid.png")  # no rows: nothing to draw


def test_distillspec_render_only_reads_a_results_json_without_its_runs(
    distillspec_workdir, tmp_path, monkeypatch):
  """Committed results render without runs_dir: every row comes back from results.json, the
  same numbers, and the plots are drawn."""
  _refuse_everything(monkeypatch)
  shutil.copy(os.path.join(distillspec_workdir, "results.json"), tmp_path / "results.json")
  before = json.load(open(tmp_path / "results.json"))
  config = distillspec_config.get_config("smoke")
  config.render_only = True
  assert testing.dispatch(config, str(tmp_path)) == before
  md = open(tmp_path / "results.md").read()
  assert f"{len({r['run'] for r in before})} runs are not in runs_dir" in md
  def tables(text):  # every table row and finding: the numbers
    return [line for line in text.splitlines() if line.startswith(("|", "- ", "  - "))]
  assert tables(md) == tables(open(os.path.join(distillspec_workdir, "results.md")).read())
  assert os.path.getsize(tmp_path / "tau_grid.png") > 0


@pytest.mark.parametrize("override, field", [
    (dict(divergences=("kl",)), "divergences"),
    (dict(sources=()), "sources"),
    (dict(eval=dict(gamma=0)), "eval.gamma"),
    (dict(eval=dict(new_tokens=0)), "eval.new_tokens"),
    (dict(eval=dict(temperatures=(-1.0,))), "eval.temperatures"),
    (dict(eval=dict(speedup_prompts=99)), "eval.speedup_prompts"),
    (dict(lenience=dict(temperature=0.5)), "lenience.temperature"),
    (dict(lenience=dict(lin_epsilons=(1.5,))), "lenience.lin_epsilons"),
    (dict(lenience=dict(exp_epsilons=(0.0,))), "lenience.exp_epsilons")])
def test_distillspec_bad_input_names_the_field(override, field, tmp_path, monkeypatch):
  _refuse_everything(monkeypatch)
  config = distillspec_config.get_config("smoke")
  for key, value in override.items():
    if isinstance(value, dict):
      config[key].update(value)
    else:
      config[key] = value
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    testing.dispatch(config, str(tmp_path))
  assert not os.listdir(tmp_path)  # refused before anything ran or was written


def test_distillspec_a_changed_training_config_is_refused_not_read_back(tmp_path):
  """The harness reruns a training run whose config changed; distill would read the old
  checkpoint back, so the run refuses, naming runs_dir."""
  from spec_jax.evaluation import experiment
  from spec_jax.programs import distillspec_experiment as program
  config = distillspec_config.get_config("smoke")
  old = program.train_config(config, str(tmp_path), "fkl", "mix")
  with open(tmp_path / experiment.CONFIG, "w") as f:
    f.write(old.to_json_best_effort())
  new = copy.deepcopy(old)
  new.train.lr = old.train.lr * 2
  with pytest.raises(ValueError, match="runs_dir"):
    program.train(new, str(tmp_path))
  # The cache folder is not part of a drafter's identity.
  moved = program.train_config(config, str(tmp_path / "elsewhere"), "fkl", "mix")
  assert (experiment.digest(moved, ignore=program.TRAIN_IGNORE)
          == experiment.digest(old, ignore=program.TRAIN_IGNORE))


def test_distillspec_eval_rows_follow_the_drafters_training_not_its_folder():
  from spec_jax.evaluation import experiment
  from spec_jax.programs import distillspec_experiment as program
  config = distillspec_config.get_config("smoke")
  ignore = ("drafter.checkpoint",)

  def key(path, trained, t=1.0, **kw):
    return experiment.digest(program.eval_config(config, path, trained, t, **kw), ignore=ignore)
  assert key("/a/train/x", "d1") == key("/b/train/x", "d1")
  assert len({key("/a", "d1"), key("/a", "d2"), key("/a", "d1", 0.0),
              key("/a", "d1", rule="lenient", epsilon=0.3),
              key("/a", "d1", speedup=True)}) == 5


def test_distillspec_report_marks_rows_without_a_measured_r():
  """Rows without verifier_cost_ratio_r keep their theoretical speedup and say it took r = 1;
  the α prediction uses the rows' median r(M) where measured."""
  from spec_jax.evaluation import distillspec_report as rep
  config = distillspec_config.get_config("smoke")
  config.divergences, config.sources = ("fkl",), ("mix",)

  def row(drafter, t, tau, alpha, part="grid", r_m=None, **kw):
    return dict(part=part, drafter=drafter, temperature=t, block_efficiency=tau, tau_se=0.01,
                acceptance_rate=alpha, cost_ratio_c=0.1, verifier_cost_ratio_r=r_m, gamma=4,
                device="cpu", speedup=1.0, theoretical_speedup=1.1, **kw)
  rows = [row("baseline", 0.0, 1.3, 0.25, r_m=1.5), row("fkl_mix", 0.0, 1.6, 0.4, r_m=1.7),
          row("baseline", 1.0, 1.3, 0.25), row("fkl_mix", 1.0, 1.4, 0.3),
          row("fkl_mix", 1.0, 2.0, 0.3, part="lenience", lenience="lin", epsilon=0.3,
              verifier_loglik=-4.0, token_tv=0.2, ar_verifier_loglik=-3.9)]
  md = rep.render_markdown(config, rows, "cmd")
  assert "common r(M): T = 0: 1.600, T = 1: 1 (not measured)" in md
  assert "These rows carry no measured r(M)" in md  # the lenience table
  # Findings: +23.1% at greedy meets the 15% goal, +7.7% at T = 1 does not.
  assert ("(+23.1%, 21.2 standard errors of the difference, combined as if independent); the ≥ "
          "15% goal is met") in md
  assert ("(+7.7%, 7.1 standard errors of the difference, combined as if independent); the ≥ "
          "15% goal is not met") in md
  from spec_jax.evaluation import metrics
  predicted = metrics.chain_speedup(0.4, 4, c=0.1, r_m=1.6)
  assert f"| fkl_mix | 0 | 1.600 ± 0.010 | 1.231 | 0.400 | {predicted:.3f} |" in md
