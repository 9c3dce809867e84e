"""The experiments (experiments/<paper>/config.py + a program) end to end on their smoke configs,
dispatched as launch.py does; a second run reads every finished piece back instead of redoing it."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from experiments.distillspec import config as distillspec_config
from experiments.rsd import config as rsd_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dispatch(config, workdir: str):
  """What launch.py does with a config: lock it (programs may not add fields) and call
  spec_jax.programs.<config.program>.run."""
  config.lock()
  return importlib.import_module(f"spec_jax.programs.{config.program}").run(config, workdir)


def _refuse(*args, **kwargs):
  raise AssertionError("a finished piece was redone instead of read back")


@pytest.fixture(scope="module")
def rsd_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("rsd"))
  _dispatch(rsd_config.get_config("smoke"), workdir)
  return workdir


@pytest.fixture(scope="module")
def distillspec_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("distillspec"))
  _dispatch(distillspec_config.get_config("smoke"), workdir)
  return workdir


def test_rsd_config_carries_what_the_program_needs():
  config = rsd_config.get_config()
  assert config.program == "rsd_experiment" and not config.render_only
  # Part (b)'s runs as data: SD with γ = B - 1 joins the first width's runs only.
  assert config.budget_methods["K3_B10"] == ("sd@9", *rsd_config.budget_entries(10, 3))
  assert config.budget_methods["K2_B10"] == tuple(rsd_config.budget_entries(10, 2))
  assert len(config.budget_methods) == len(config.budgets) * len(config.budget_widths)
  smoke = rsd_config.get_config("smoke")
  assert smoke.verifier.size == "test-tiny" and smoke.config_file.endswith("config.py:smoke")


def test_rsd_smoke_writes_results_and_resumes(rsd_workdir, monkeypatch):
  config = rsd_config.get_config("smoke")
  names = sorted(os.listdir(os.path.join(rsd_workdir, "runs")))
  assert names == ["fixed_budget_K3_B4_spec_jax_shakespeare_T1",
                   "fixed_length_L1_spec_jax_shakespeare_T0",
                   "fixed_length_L1_spec_jax_shakespeare_T1",
                   "level_acceptance_spec_jax_shakespeare.json"]
  for name in ("results.md", "tau_vs_depth.png", "tau_vs_budget.png"):
    assert os.path.getsize(os.path.join(rsd_workdir, name)) > 0
  rows = json.load(open(os.path.join(rsd_workdir, "results.json")))
  fixed = {(r["method"], r["temperature"]) for r in rows if r["part"] == "fixed_length"}
  assert fixed == ({(m, 1.0) for m in ("autoregressive", *config.fixed_methods)}
                   | {(m, 0.0) for m in ("autoregressive", *config.greedy_methods)})
  budget = [r for r in rows if r["part"] == "fixed_budget" and r["method"] != "autoregressive"]
  assert {r["verifier_tokens_per_call"] for r in budget} <= {3, 4}  # B = 4: every shape fits
  assert all(r["identical_to_greedy"] for r in rows if r["temperature"] == 0.0)
  md = open(os.path.join(rsd_workdir, "results.md")).read()
  assert (f"Command: `python launch.py --config experiments/rsd/config.py:smoke --workdir "
          f"{rsd_workdir}`") in md
  assert "Does RSD-S ≥ RSD-C ≥ SpecTr ≥ SD (τ) hold at fixed L?" in md
  assert "**block_efficiency**" in md
  # Counts only: wall-clock speedups of an hours-long, paused-and-resumed run stay in results.json.
  assert "speedup" not in md.split("## Glossary")[1] and "kept in results.json" in md
  assert all("speedup" in r for r in rows)
  # Part (c): per-level acceptance per rule and k; at k = 1 every rule is SD.
  levels, = json.load(open(os.path.join(rsd_workdir, "level_acceptance.json")))
  assert levels["k"] == [1, 2] and levels["rows"] == config.eval.num_prompts
  for rule in ("specinfer", "spectr", "rsd"):
    assert levels[rule][0] == pytest.approx(levels["sd"][0], abs=1e-3)
  assert "## (c) Why the rules differ" in md and "With k = 2 candidates a level accepts" in md
  assert len(levels["spectr_minus_specinfer_se"]) == 2

  # Resume: every evaluate run and the analysis are read back, the report comes out the same.
  from spec_jax.evaluation import multidraft
  from spec_jax.programs import evaluate
  monkeypatch.setattr(evaluate, "run", _refuse)
  monkeypatch.setattr(multidraft, "analyse", _refuse)
  again = _dispatch(rsd_config.get_config("smoke"), rsd_workdir)
  assert again == rows and json.load(open(os.path.join(rsd_workdir, "results.json"))) == rows
  assert open(os.path.join(rsd_workdir, "results.md")).read() == md


def test_rsd_ordering_check_on_synthetic_rows():
  """Verdicts from τ and its standard error: in order → holds; a pair reversed by more than
  2 SE → does not hold; out of order within noise → within noise."""
  from spec_jax.programs import rsd_experiment
  def rows(taus, depth, se):
    return [dict(method=m, block_efficiency=t, tau_se=se, dataset="d", temperature=1.0,
                 gamma=depth) for m, t in zip(rsd_experiment.FIXED_ORDER, taus)]
  synthetic = (rows((2.0, 1.9, 1.8, 1.5), 2, 0.01) + rows((2.0, 2.1, 1.8, 1.9), 3, 0.01)
               + rows((2.0, 2.05, 1.8, 1.5), 4, 0.05)
               + [dict(method="sd", block_efficiency=1.4, tau_se=0.01, dataset="d",
                       temperature=1.0, gamma=5)])  # an incomplete setting is skipped
  # Greedy: SpecTr is SD's chain and is not needed; RSD-C below SD beyond noise.
  greedy = [dict(r, temperature=0.0) for r in rows((1.6, 1.2, 0.0, 1.3), 2, 0.01)
            if r["method"] != "spectr"]
  lines, counts, trees_win = rsd_experiment.ordering_checks(synthetic + greedy)
  assert counts == {"holds": 1, "within noise": 1, "does not hold": 2} and trees_win == 2
  assert lines[2:] == [
      "| d | 0 | 2 | 1.60 ± 0.01 | 1.20 ± 0.01 | = sd (greedy) | 1.30 ± 0.01 | > < | does not hold |",
      "| d | 1 | 2 | 2.00 ± 0.01 | 1.90 ± 0.01 | 1.80 ± 0.01 | 1.50 ± 0.01 | > > > | holds |",
      "| d | 1 | 3 | 2.00 ± 0.01 | 2.10 ± 0.01 | 1.80 ± 0.01 | 1.90 ± 0.01 | < > < | does not hold |",
      "| d | 1 | 4 | 2.00 ± 0.05 | 2.05 ± 0.05 | 1.80 ± 0.05 | 1.50 ± 0.05 | ≈ > > | within noise |"]


def test_rsd_plot_series_all_look_different():
  from spec_jax.programs import rsd_experiment
  labels = [f"{m} T={t} {d}" for m in rsd_experiment.FIXED_ORDER + ("specinfer",)
            for t in (0, 1) for d in ("shakespeare", "pystdlib")]
  styles = {tuple(sorted(rsd_experiment._style(label).items())) for label in labels}
  assert len(styles) == len(labels)  # matplotlib's default cycle repeated colours past 10


def test_rsd_render_only_runs_nothing(tmp_path, monkeypatch):
  from spec_jax.programs import evaluate
  monkeypatch.setattr(evaluate, "run", _refuse)
  config = rsd_config.get_config("smoke")
  config.render_only = True
  config.note = "Made in two sessions."
  assert _dispatch(config, str(tmp_path)) == []
  md = open(tmp_path / "results.md").read()
  assert "The order holds in 0 of 0 settings" in md
  assert "\n\nMade in two sessions.\n\n" in md  # the config's note, under the heading
  assert not os.path.exists(tmp_path / "runs" / "fixed_length_L1_spec_jax_shakespeare_T1")
  # It says which runs have not finished.
  assert ("**Not finished yet: 3 runs** (fixed_length_L1_spec_jax_shakespeare_T1, "
          "fixed_budget_K3_B4_spec_jax_shakespeare_T1, fixed_length_L1_spec_jax_shakespeare_T0)"
          ) in md


def test_rsd_prompts_are_checked_for_every_dataset_before_any_run(tmp_path):
  config = rsd_config.get_config("smoke")
  config.datasets = ("spec_jax_shakespeare", "spec_jax_pystdlib")
  config.prompt_splits = {}
  config.eval.num_prompts = config.num_data_prompts = 5000  # more than any test split holds
  with pytest.raises(ValueError, match="Split 'test' of 'spec_jax_shakespeare' has only"):
    _dispatch(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")  # nothing ran


def test_rsd_budget_methods_must_cover_the_budgets(tmp_path):
  config = rsd_config.get_config("smoke")
  config.budgets = (5,)  # an override get_config did not see
  with pytest.raises(ValueError, match="budget_methods has no entry 'K3_B5'"):
    _dispatch(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")  # nothing ran


def test_rsd_through_the_launcher(rsd_workdir):
  """launch.py dispatches the experiment (no second absl app) and accepts its overrides; with
  render_only it reports the finished runs it finds."""
  result = subprocess.run(
      [sys.executable, "launch.py", "--config", "experiments/rsd/config.py:smoke",
       "--workdir", rsd_workdir, "--config.render_only=True"],
      cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  md = open(os.path.join(rsd_workdir, "results.md")).read()
  assert ("Command: `python launch.py --config experiments/rsd/config.py:smoke --workdir "
          f"{rsd_workdir}`") in md  # the render_only override is not part of the command
  assert "### spec_jax_shakespeare, T = 0" in md
  assert "Not finished yet" not in md


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
  for name in ("results.md", "tau_grid.png", "lenience_tradeoff.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  assert sorted(os.listdir(os.path.join(workdir, "runs", "train"))) == ["baseline", "fkl_mix"]
  assert os.listdir(os.path.join(workdir, "runs", "verifier_cache"))  # the mix's responses
  results = json.load(open(os.path.join(workdir, "results.json")))
  assert set(results["trained"]) == {"baseline", "fkl_mix"}
  assert {(r["drafter"], r["temperature"]) for r in results["grid"]} == {
      (n, t) for n in ("baseline", "fkl_mix") for t in (0.0, 1.0)}
  for r in results["grid"]:
    assert 1.0 <= r["block_efficiency"] <= config.eval.gamma + 1
    assert 0.0 <= r["acceptance_rate"] <= 1.0 and r["tau_se"] >= 0 and r["token_tv"] == 0
  # Lenience: f_lin over ε for the best distilled drafter and the baseline, f_exp for the best.
  lenient = {(r["lenience"], r["epsilon"]) for r in results["lenience"]}
  assert lenient == {("lin", 1.0), ("lin", 0.3), ("exp", 0.3)}
  assert all(r["token_tv"] > 0 for r in results["lenience"] if r["epsilon"] < 1)
  assert {r["drafter"] for r in results["speedup"]} <= {"baseline", "fkl_mix"}
  md = open(os.path.join(workdir, "results.md")).read()
  assert (f"Produced by `python launch.py --config experiments/distillspec/config.py:smoke "
          f"--workdir {workdir}`") in md
  assert "## Findings (computed from the numbers above)" in md and "CE baseline" in md

  # Resume: no drafter is trained and no row decoded again; the same results come out.
  from spec_jax.programs import distill, distillspec_experiment
  monkeypatch.setattr(distill, "run", _refuse)
  monkeypatch.setattr(distillspec_experiment, "_chain_sd", _refuse)
  again = _dispatch(distillspec_config.get_config("smoke"), workdir)
  assert again == results == json.load(open(os.path.join(workdir, "results.json")))
  assert open(os.path.join(workdir, "results.md")).read() == md


def test_distillspec_render_only_runs_nothing(tmp_path, monkeypatch):
  from spec_jax.programs import distill, distillspec_experiment
  monkeypatch.setattr(distill, "run", _refuse)
  monkeypatch.setattr(distillspec_experiment, "_chain_sd", _refuse)
  config = distillspec_config.get_config("smoke")
  config.render_only = True
  assert _dispatch(config, str(tmp_path)) == dict(trained={}, grid=[], lenience=[], speedup=[])
  assert os.path.exists(tmp_path / "results.md") and os.path.exists(tmp_path / "tau_grid.png")
