"""The BPD experiment (experiments/bpd/config.py, program bpd_experiment) end to end on its smoke
config through launch.py: every method's rows, the report and plots; a second run reads every
finished piece back (nothing trains, decodes or analyses again); render_only runs nothing; bad
fields fail before anything runs."""

import json
import math
import os
import subprocess
import sys

import pytest

from experiments.bpd import config as bpd_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNGS = ("tau_by_method.png", "oracle_vs_k.png", "entropy_repetition.png")


def _refuse(*args, **kwargs):
  raise AssertionError("a finished piece was redone instead of read back")


def _run(config, workdir):
  """What launch.py does with a config: lock it (programs may not add fields), then run."""
  from spec_jax.programs import bpd_experiment
  config.lock()
  return bpd_experiment.run(config, workdir)


def test_bpd_experiment_smoke_resumes_and_renders(tmp_path, data_dir, monkeypatch):
  # Through the launcher in a subprocess (it writes the shared compilation cache, so a rerun of
  # the suite compiles nothing), on the Shakespeare corpus the data_dir fixture prepared.
  monkeypatch.setenv("SPEC_JAX_DATA_DIR", data_dir)
  workdir = str(tmp_path / "bpd")
  result = subprocess.run(
      [sys.executable, "launch.py", "--config", "experiments/bpd/config.py:smoke",
       "--workdir", workdir], cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "wrote results.json, results.md, tau_by_method.png" in result.stdout

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

  # Resume in this process: every piece is read back, the report comes out the same.
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

  # Bad fields fail before anything runs, naming the field.
  for field, value, message in (
      ("datasets", ("shakespeare",), "datasets has 'shakespeare'"),
      ("heads", (0,), "heads has 0"), ("heads", (), "heads is empty"),
      ("temperatures", (-1.0,), "temperatures has -1.0"),
      ("ngram_paths", (32,), "ngram_paths has 32"),
      ("top_k_per_heads", {"x2": 4}, "top_k_per_heads has 'x2'"),
      # k = 1 for h = 2 leaves one lattice path, fewer than the 4 and 16 bpd_ngram keeps.
      ("top_k_per_heads", {"h2": 1}, r"ngram_paths has 4, but h = 2 heads with a top-1"),
      ("oracle_k", 3, "gives k = 3 for h = 2, which is not in analysis_ks"),
      ("carry", ("spec_jax_shakespeare_h9",), "carry has 'spec_jax_shakespeare_h9', which is "
       "not one of this config's settings"),
      ("carry", ("spec_jax_shakespeare_h2",), r"takes rows from carry_from='', which is not a "
       "file")):
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
