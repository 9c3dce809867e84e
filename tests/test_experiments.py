"""The experiments (experiments/<paper>/config.py + a program) end to end on their smoke configs,
dispatched as launch.py does; a second run reads every finished piece back instead of redoing it."""

import json
import os
import sys

import pytest

from experiments.rsd import config as rsd_config
from spec_jax import testing

@pytest.fixture(scope="module")
def rsd_workdir(tmp_path_factory):
  """The RSD experiment's smoke run, dispatched as launch.py does, in this process (it reuses
  the programs earlier tests compiled; the launcher is tested in tests/test_console.py)."""
  workdir = str(tmp_path_factory.mktemp("rsd"))
  testing.dispatch(rsd_config.get_config("smoke"), workdir)
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
  """End to end (fixture); then a rerun that runs nothing."""
  config = rsd_config.get_config("smoke")
  names = sorted(os.listdir(os.path.join(rsd_workdir, "runs")))
  assert names == ["fixed_budget_K3_B4_spec_jax_shakespeare_T1",
                   "fixed_length_L1_spec_jax_shakespeare_T0",
                   "fixed_length_L1_spec_jax_shakespeare_T1",
                   "level_acceptance_spec_jax_shakespeare"]
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
  assert "### spec_jax_shakespeare, T = 0" in md and "Not finished yet" not in md
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
  monkeypatch.setattr(evaluate, "run", testing.refuse)
  monkeypatch.setattr(multidraft, "analyse", testing.refuse)
  again = testing.dispatch(rsd_config.get_config("smoke"), rsd_workdir)
  assert again == rows and json.load(open(os.path.join(rsd_workdir, "results.json"))) == rows
  assert open(os.path.join(rsd_workdir, "results.md")).read() == md


def test_rsd_ordering_check_on_synthetic_rows():
  """Verdicts from τ and its standard error: in order → holds; a pair reversed by more than
  2 SE → does not hold; out of order within noise → within noise."""
  from spec_jax.evaluation import rsd_report
  def rows(taus, depth, se):
    return [dict(method=m, block_efficiency=t, tau_se=se, dataset="d", temperature=1.0,
                 gamma=depth) for m, t in zip(rsd_report.FIXED_ORDER, taus)]
  synthetic = (rows((2.0, 1.9, 1.8, 1.5), 2, 0.01) + rows((2.0, 2.1, 1.8, 1.9), 3, 0.01)
               + rows((2.0, 2.05, 1.8, 1.5), 4, 0.05)
               + [dict(method="sd", block_efficiency=1.4, tau_se=0.01, dataset="d",
                       temperature=1.0, gamma=5)])  # an incomplete setting is skipped
  # Greedy: SpecTr is SD's chain and is not needed; RSD-C below SD beyond noise.
  greedy = [dict(r, temperature=0.0) for r in rows((1.6, 1.2, 0.0, 1.3), 2, 0.01)
            if r["method"] != "spectr"]
  lines, counts, trees_win = rsd_report.ordering_checks(synthetic + greedy)
  assert counts == {"holds": 1, "within noise": 1, "does not hold": 2} and trees_win == 2
  assert lines[2:] == [
      "| d | 0 | 2 | 1.60 ± 0.01 | 1.20 ± 0.01 | = sd (greedy) | 1.30 ± 0.01 | > < | does not hold |",
      "| d | 1 | 2 | 2.00 ± 0.01 | 1.90 ± 0.01 | 1.80 ± 0.01 | 1.50 ± 0.01 | > > > | holds |",
      "| d | 1 | 3 | 2.00 ± 0.01 | 2.10 ± 0.01 | 1.80 ± 0.01 | 1.90 ± 0.01 | < > < | does not hold |",
      "| d | 1 | 4 | 2.00 ± 0.05 | 2.05 ± 0.05 | 1.80 ± 0.05 | 1.50 ± 0.05 | ≈ > > | within noise |"]


def test_rsd_plot_series_all_look_different():
  from spec_jax.evaluation import rsd_report
  labels = [f"{m} T={t} {d}" for m in rsd_report.FIXED_ORDER + ("specinfer",)
            for t in (0, 1) for d in ("shakespeare", "pystdlib")]
  styles = {tuple(sorted(rsd_report.style(label).items())) for label in labels}
  assert len(styles) == len(labels)  # matplotlib's default cycle repeated colours past 10


def _synthetic_run(setting) -> list[dict]:
  """Rows an evaluate run of one setting could give (no model): the autoregressive baseline
  and, per entry NAME[:W]@L, τ rising with L (trees above SD), SE 0.01."""
  rows = [dict(method="autoregressive", tree=None, gamma=None, block_efficiency=1.0,
               tau_se=None, verifier_tokens_per_call=1, speedup=1.0)]
  for entry in setting.methods:
    name, depth = entry.split("@")
    name, _, width = name.partition(":")
    depth, width = int(depth), int(width or 3)
    tree = None if name == "sd" else f"{name} W={width} L={depth}"
    rows.append(dict(method=name, tree=tree, gamma=depth, tau_se=0.01, speedup=1.5,
                     block_efficiency=round(1.0 + 0.1 * depth + (0.2 if tree else 0.0), 2),
                     verifier_tokens_per_call=depth + 1 if tree is None else width * depth + 1))
  for r in rows:
    r.update(dataset=setting.dataset, temperature=setting.temperature, device="cpu",
             verifier="v", drafter="d")
  return rows


def test_rsd_render_only_reads_back_and_runs_nothing(tmp_path, monkeypatch):
  """Without models: render_only over no runs lists every unfinished run; over finished runs
  (synthetic rows, as committed runs are: results.json without config.json) it reports their
  tables, the ordering check, part (b) and both plots, and runs nothing."""
  from spec_jax.evaluation import multidraft, rsd_report
  from spec_jax.programs import evaluate, rsd_experiment
  monkeypatch.setattr(evaluate, "run", testing.refuse)
  monkeypatch.setattr(multidraft, "analyse", testing.refuse)
  monkeypatch.setattr(sys, "argv", ["launch.py", "--config", "experiments/rsd/config.py:smoke",
                                    "--workdir", str(tmp_path), "--config.render_only=True"])
  config = rsd_config.get_config("smoke")
  config.render_only = True
  config.note = "Made in two sessions."
  assert testing.dispatch(config, str(tmp_path)) == []
  md = open(tmp_path / "results.md").read()
  assert "The order holds in 0 of 0 settings" in md
  assert "\n\nMade in two sessions.\n\n" in md  # the config's note, under the heading
  # The command that reruns it: the render_only override is not part of it.
  assert (f"Command: `python launch.py --config experiments/rsd/config.py:smoke --workdir "
          f"{tmp_path}`. ") in md
  assert not os.path.exists(tmp_path / "runs" / "fixed_length_L1_spec_jax_shakespeare_T1")
  assert not os.path.exists(tmp_path / "tau_vs_depth.png")  # no rows: nothing to plot
  # It says which runs have not finished.
  assert ("**Not finished yet: 4 runs** (level_acceptance_spec_jax_shakespeare, "
          "fixed_length_L1_spec_jax_shakespeare_T1, fixed_budget_K3_B4_spec_jax_shakespeare_T1, "
          "fixed_length_L1_spec_jax_shakespeare_T0)") in md

  config = rsd_config.get_config("smoke")
  config.render_only = True
  config.fixed_methods = config.greedy_methods = rsd_report.FIXED_ORDER
  config.budget_widths, config.budgets, config.level_ks = (3, 2), (4, 5), (1, 2)
  config.budget_methods = {"K3_B4": ("sd@3", "rsd_s:3@1"), "K3_B5": ("sd@4", "rsd_s:3@1"),
                           "K2_B4": ("rsd_s:2@1",), "K2_B5": ("rsd_s:2@2",)}
  plan = rsd_experiment.settings(config)
  assert [s.name for s in plan] == [
      "fixed_length_L1_spec_jax_shakespeare_T1", "fixed_budget_K3_B4_spec_jax_shakespeare_T1",
      "fixed_budget_K3_B5_spec_jax_shakespeare_T1", "fixed_budget_K2_B4_spec_jax_shakespeare_T1",
      "fixed_budget_K2_B5_spec_jax_shakespeare_T1", "fixed_length_L1_spec_jax_shakespeare_T0"]
  assert plan[1].methods == ("sd@3",)  # rsd_s:3@1 is part (a)'s shape: read from its rows
  for s in plan:
    os.makedirs(tmp_path / "runs" / s.name)
    json.dump(_synthetic_run(s), open(tmp_path / "runs" / s.name / "results.json", "w"))
  level = dict(k=[1, 2], rows=2, positions=8, dataset="spec_jax_shakespeare", temperature=1.0,
               rho=[1.0, 1.8], **{f"{n}{e}": [0.3, 0.4] for n in multidraft.RULES
                                  for e in ("", "_se")},
               **{f"{a}_minus_{b}{e}": [0.0, 0.01] for a, b in multidraft.PAIRS
                  for e in ("", "_se")})
  os.makedirs(tmp_path / "runs" / "level_acceptance_spec_jax_shakespeare")
  json.dump([level], open(tmp_path / "runs" / "level_acceptance_spec_jax_shakespeare" /
                          "results.json", "w"))
  rows = testing.dispatch(config, str(tmp_path))
  assert len(rows) == sum(len(s.methods) + 1 for s in plan)
  assert {r["part"] for r in rows} == {"fixed_length", "fixed_budget"}
  assert json.load(open(tmp_path / "level_acceptance.json")) == [level]
  md = open(tmp_path / "results.md").read()
  assert "Not finished yet" not in md and "With k = 2 candidates a level accepts" in md
  assert ("| spec_jax_shakespeare | 1 | 1 | 1.30 ± 0.01 | 1.30 ± 0.01 | 1.30 ± 0.01 | "
          "1.10 ± 0.01 | ≈ ≈ > | holds |") in md
  assert "The order holds in 2 of 2 settings" in md
  assert "plus width-2 trees for B ∈ {4, 5}." in md
  # B = 5: SD's best shape is γ = 4; RSD-S's is the width-2 tree that just fits.
  assert ("| 5 | 1.40 ± 0.01 (rsd_s W=2 L=2) | 1.30 ± 0.01 (rsd_c W=3 L=1) | 1.30 ± 0.01 "
          "(spectr W=3 L=1) | 1.40 ± 0.01 (γ=4) | rsd_s | holds |") in md
  # Each cell is a maximum over shapes: the selection it carries is said, with the counts (SD:
  # γ = 1, 3 and 4; RSD-S: part (a)'s shape and the two width-2 trees).
  assert ("within B (at the largest B: rsd_s 3, rsd_c 1, spectr 1, sd 3 shapes): the largest "
          "of noisy estimates is biased upwards") in md
  assert "(this run's: 1.50–1.50×)" in md
  for name in ("tau_vs_depth.png", "tau_vs_budget.png"):
    assert os.path.getsize(tmp_path / name) > 0
  depth, budget = rsd_report.plot_series(config, rows)
  assert sorted(depth) == sorted(f"{m} T={t} shakespeare" for m in rsd_report.FIXED_ORDER
                                 for t in (0, 1))
  assert depth["sd T=1 shakespeare"] == ([1], [1.1], [0.01])
  # Part (b)'s series: the best τ within each budget, over both parts' rows at its temperature.
  assert budget["sd shakespeare"] == ([4, 5], [1.3, 1.4], [0.01, 0.01])
  assert budget["rsd_s shakespeare"] == ([4, 5], [1.3, 1.4], [0.01, 0.01])


def test_rsd_runs_resume_on_what_changes_their_results():
  """A run's digest moves with what its result depends on, not with the experiment's own
  fields: a new note or budget list keeps part (a)'s finished runs."""
  from spec_jax.evaluation import experiment
  from spec_jax.programs import rsd_experiment

  def digests(**changes):
    config = rsd_config.get_config("smoke")
    for key, value in changes.items():
      section, _, name = key.rpartition("__")
      (config[section] if section else config)[name] = value
    return {r.name: experiment.digest(r.config, ignore=r.ignore)
            for r in rsd_experiment.runs(config, "w")}
  base = digests()
  level, fixed = "level_acceptance_spec_jax_shakespeare", "fixed_length_L1_spec_jax_shakespeare_T1"
  assert digests(note="another session", budgets=(4,), title="t") == base
  for change in (dict(level_ks=(1, 2, 3)), dict(level_draws=3), dict(eval__new_tokens=7)):
    assert digests(**change)[level] != base[level], change
  assert digests(level_ks=(1, 2, 3))[fixed] == base[fixed]
  assert digests(eval__new_tokens=7)[fixed] != base[fixed]


def test_rsd_prompts_are_checked_for_every_dataset_before_any_run(tmp_path):
  config = rsd_config.get_config("smoke")
  config.datasets = ("spec_jax_shakespeare", "spec_jax_pystdlib")
  config.prompt_splits = {}
  config.eval.num_prompts = config.num_data_prompts = 5000  # more than any test split holds
  with pytest.raises(ValueError, match="Split 'test' of 'spec_jax_shakespeare' has only"):
    testing.dispatch(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")  # nothing ran


def test_rsd_budget_methods_must_cover_the_budgets(tmp_path):
  config = rsd_config.get_config("smoke")
  config.budgets = (5,)  # an override get_config did not see
  with pytest.raises(ValueError, match="budget_methods has no entry 'K3_B5'"):
    testing.dispatch(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")  # nothing ran
  config.render_only = True  # even when it would run nothing
  with pytest.raises(ValueError, match="budget_methods has no entry 'K3_B5'"):
    testing.dispatch(config, str(tmp_path))
