"""The drafters experiment (scratch, verifier-initialised and reduced-vocabulary drafters, each
built and measured) end to end on its smoke config, its resume and its bad input."""

import json
import os

import pytest

from experiments.drafters import config as drafters_config
from spec_jax.programs import drafters_experiment


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
    assert r["theoretical_speedup"] == pytest.approx(r["block_efficiency"] / (
        r["verifier_cost_ratio_r"] + r["gamma"] * r["cost_ratio_c"]), rel=1e-3)
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


def test_a_rerun_reads_everything_back(smoke):
  config, workdir, rows = smoke
  stamps = {n: os.path.getmtime(os.path.join(workdir, "runs", "train", n, "build.json"))
            for n in config.drafters}
  config.render_only = True
  assert drafters_experiment.run(config, workdir) == rows
  assert stamps == {n: os.path.getmtime(os.path.join(workdir, "runs", "train", n, "build.json"))
                    for n in config.drafters}


def test_carried_and_skipped_entries_are_neither_built_nor_measured(smoke, tmp_path):
  """Entries in `carry` take their rows from an earlier results.json, entries in `skip` are left
  out; nothing is built or timed for either, and results.md names the carried ones."""
  config, workdir, rows = smoke
  config = drafters_config.get_config("smoke")
  config.update(carry=("scratch-t", "vinit-1"), skip=("vinit-1-v64",),
                carry_from=os.path.join(workdir, "results.json"))
  got = drafters_experiment.run(config, str(tmp_path))
  assert got == [r for r in rows if r["drafter"] in ("scratch-t", "vinit-1")]
  assert not os.path.exists(tmp_path / "runs" / "train")
  assert "Rows of scratch-t, vinit-1 are carried from" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(carry=("scratch-t",), carry_from="x.json"),
     "drafters.vinit-1 starts from 'scratch-t', which is carried"),
    (lambda c: c.update(skip=("vinit-1",)), "drafters.vinit-1-v64 starts from 'vinit-1', which "
                                           "is skipped"),
    (lambda c: c.update(carry=("nope",)), r"carry / skip list \['nope'\]"),
    (lambda c: c.update(carry=("scratch-t", "vinit-1", "vinit-1-v64"), carry_from="none.json"),
     "needs carry_from=<an earlier results.json>"),
    (lambda c: c.drafters["vinit-1"].update(kind="magic"), "kind='magic'"),
    (lambda c: c.drafters["vinit-1-v64"].update(base="nope"), "needs base=<another entry>"),
    (lambda c: setattr(c, "order", ("scratch-t", "vinit-1-v64", "vinit-1")),
     "'vinit-1' must come before 'vinit-1-v64'"),
    (lambda c: setattr(c, "order", ("vinit-1",)), "must list every entry"),
])
def test_bad_entries_are_named_before_anything_runs(tmp_path, change, message):
  config = drafters_config.get_config("smoke")
  change(config)
  with pytest.raises(ValueError, match=message):
    drafters_experiment.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")
