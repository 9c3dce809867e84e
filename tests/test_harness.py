"""The experiment harness (spec_jax/evaluation/experiment.py) on fake programs, no models: the
digest rule, resume and render_only in run_all, carried rows, the outputs and the plot."""

import json
import os
import sys
import types

import ml_collections
import pytest

from spec_jax.evaluation import experiment

PROGRAM = "harness_fake"


@pytest.fixture
def fake_program(monkeypatch):
  """A program `harness_fake`: configs/harness_fake.py's defaults (lr, steps, a model section,
  a title), and a module with DIGEST_IGNORE (title), digest_defaults() (options.width = 3) and a
  run() that records its calls."""
  def get_config():
    return ml_collections.ConfigDict(dict(program=PROGRAM, lr=0.1, steps=10, title="t",
                                          model=dict(size="s", checkpoint=""),
                                          sweep=(1, 2)))
  calls = []

  def run(config, workdir):
    calls.append((config.to_dict(), workdir))
    return [dict(value=config.lr * config.steps)]
  monkeypatch.setitem(sys.modules, f"configs.{PROGRAM}",
                      types.SimpleNamespace(get_config=get_config))
  monkeypatch.setitem(sys.modules, f"spec_jax.programs.{PROGRAM}", types.SimpleNamespace(
      run=run, DIGEST_IGNORE=("title",), digest_defaults=lambda: {"options.width": 3}))
  experiment._default_config.cache_clear()
  experiment._defaults.cache_clear()
  yield get_config, calls
  experiment._default_config.cache_clear()
  experiment._defaults.cache_clear()


def _refuse(*args, **kwargs):
  raise AssertionError("a finished run was run again instead of read back")


def test_digest_drops_defaults_and_ignored_keys(fake_program, tmp_path):
  get_config, _ = fake_program
  base = get_config()
  d = experiment.digest(base)
  # A field the program gained later, at its default, leaves the digest as it was: an old
  # config.json without it and a new config with it are the same run.
  old = base.to_dict()
  del old["model"]["checkpoint"]
  assert experiment.digest(old, program=PROGRAM) == d
  with_option = base.copy_and_resolve_references()
  with_option.options = dict(width=3)  # the module's digest_defaults() value
  assert experiment.digest(with_option) == d
  # Fields that change the result change it, defaults or not.
  for key, value in (("lr", 0.2), ("model.checkpoint", "ckpt"), ("sweep", (1, 2, 3))):
    changed = base.copy_and_resolve_references()
    section, _, leaf = key.rpartition(".")
    (changed[section] if section else changed)[leaf] = value
    assert experiment.digest(changed) != d, key
  with_option.options.width = 4
  assert experiment.digest(with_option) != d
  extra = base.copy_and_resolve_references()
  extra.model.note = "a field the defaults lack, in a section the program reads"
  assert experiment.digest(extra) != d
  # A top-level field the program's config file lacks is an experiment's own: not digested.
  own = base.copy_and_resolve_references()
  own.budgets = (6, 10)
  assert experiment.digest(own) == d
  # Ignored: the program's DIGEST_IGNORE, the run's own keys (a key covers what is under it).
  titled = base.copy_and_resolve_references()
  titled.title = "another title"
  assert experiment.digest(titled) == d
  assert experiment.digest(extra, ignore=("model.note",)) == d
  other_model = base.copy_and_resolve_references()
  other_model.model.size = "m"
  assert experiment.digest(other_model, ignore=("model",)) == d
  assert experiment.digest(other_model, ignore=("model.size",)) == d
  assert experiment.digest(other_model, ignore=("model.checkpoint",)) != d
  # A saved config.json (tuples as lists) digests like the config it was written from.
  path = tmp_path / "config.json"
  path.write_text(other_model.to_json_best_effort(indent=2))
  assert experiment.digest(str(path)) == experiment.digest(other_model) != d


def test_program_config_keeps_the_programs_fields(fake_program):
  """An experiment's own fields stay out of its runs' configs (and so out of their digests)."""
  get_config, _ = fake_program
  config = get_config()
  config.program = "some_experiment"
  config.lr = 0.5
  config.experiment_note = "only the experiment reads this"
  config.model.size = "m"
  cfg = experiment.program_config(config, PROGRAM)
  assert cfg.program == PROGRAM and "experiment_note" not in cfg
  assert cfg.lr == 0.5 and cfg.model.size == "m" and cfg.sweep == (1, 2)
  cfg.lr = 0.7  # a copy: the experiment's config is left as it was
  assert config.lr == 0.5
  assert experiment.digest(cfg) != experiment.digest(get_config())


def test_measured_names_what_the_rows_measured():
  rows = [dict(drafter="b"), dict(drafter="a"), dict(drafter="b"), dict(drafter=None), {}]
  assert experiment.measured(rows, "drafter", "config's") == "a, b"
  assert experiment.measured(rows[3:], "drafter", "config's") == "config's"


def test_digest_of_a_program_without_defaults():
  config = ml_collections.ConfigDict(dict(program="no_such_program", a=1))
  assert experiment.digest(config) != experiment.digest(dict(program="no_such_program", a=2))
  assert experiment.digest(config) == experiment.digest(dict(program="no_such_program", a=1))


def _runs(get_config, lrs, tags=True):
  for lr in lrs:
    config = get_config()
    config.lr = lr
    yield experiment.Run(f"lr{lr}", config, tags=dict(part="a") if tags else {})


def test_run_all_runs_once_then_reads_back(fake_program, tmp_path, monkeypatch):
  get_config, calls = fake_program
  workdir = str(tmp_path)
  top = ml_collections.ConfigDict(dict(render_only=False))
  first = experiment.run_all(top, workdir, _runs(get_config, (0.1, 0.2)))
  assert [c[1] for c in calls] == [os.path.join(workdir, "runs", n) for n in ("lr0.1", "lr0.2")]
  assert first.rows == [dict(value=1.0, part="a", run="lr0.1"),
                        dict(value=2.0, part="a", run="lr0.2")]
  assert first.missing == [] and list(first.by_run) == ["lr0.1", "lr0.2"]
  for name in ("lr0.1", "lr0.2"):  # the program wrote neither: the harness did
    assert os.path.exists(tmp_path / "runs" / name / "config.json")
    assert json.load(open(tmp_path / "runs" / name / "results.json"))[0]["value"] in (1.0, 2.0)
  # The same runs again: nothing runs, the rows come back the same.
  monkeypatch.setattr(sys.modules[f"spec_jax.programs.{PROGRAM}"], "run", _refuse)
  again = experiment.run_all(top, workdir, _runs(get_config, (0.1, 0.2)))
  assert again.rows == first.rows and again.by_run == first.by_run
  # A title (ignored) changes nothing; a changed result field runs that run again.
  calls.clear()
  monkeypatch.setattr(sys.modules[f"spec_jax.programs.{PROGRAM}"], "run",
                      lambda c, d: calls.append(d) or [dict(value=-1.0)])

  def changed():
    for run in _runs(get_config, (0.1, 0.2)):
      run.config.title = "retitled"
      if run.name == "lr0.2":
        run.config.steps = 20
      yield run
  third = experiment.run_all(top, workdir, changed())
  assert calls == [os.path.join(workdir, "runs", "lr0.2")]
  assert [r["value"] for r in third.rows] == [1.0, -1.0]


def test_a_change_of_inputs_runs_again(fake_program, tmp_path):
  """Run.inputs (e.g. the digest of the run that built a checkpoint read by path): the same
  inputs read back, other inputs run again, and the superseded result is kept aside."""
  get_config, calls = fake_program
  top = ml_collections.ConfigDict(dict(render_only=False))

  def train(steps):
    config = get_config()
    config.steps = steps
    return experiment.Run("train", config)

  def evaluate(steps):
    return [experiment.Run("eval", get_config(),
                           inputs={"drafter": experiment.run_digest(train(steps))})]
  assert experiment.run_digest(train(10)) != experiment.run_digest(train(20))
  experiment.run_all(top, str(tmp_path), evaluate(10))
  saved = json.load(open(tmp_path / "runs" / "eval" / "inputs.json"))
  assert saved == {"drafter": experiment.run_digest(train(10))} and len(calls) == 1
  experiment.run_all(top, str(tmp_path), evaluate(10))
  assert len(calls) == 1  # the same inputs: read back
  experiment.run_all(top, str(tmp_path), evaluate(20))
  assert len(calls) == 2 and os.path.exists(tmp_path / "runs" / "eval.previous" / "results.json")
  experiment.run_all(top, str(tmp_path), [experiment.Run("eval", get_config())])
  assert len(calls) == 3 and not os.path.exists(tmp_path / "runs" / "eval" / "inputs.json")


def test_a_changed_run_starts_from_nothing_of_the_old_setting(fake_program, tmp_path,
                                                              monkeypatch):
  """A program that resumes from what its directory holds (a checkpoint, a row log): killed
  half-way and run again with the same setting, it resumes; run with another setting (a new
  digest, or new inputs: a drafter rebuilt at the same path), it finds an empty directory (the
  old one set aside as <name>.previous) but for data_cache, which is carried over."""
  get_config, _ = fake_program
  top = ml_collections.ConfigDict(dict(render_only=False))
  seen = []

  def resuming(config, workdir):
    state = os.path.join(workdir, "state.txt")
    seen.append((open(state).read() if os.path.exists(state) else None,
                 os.path.exists(os.path.join(workdir, "data_cache", "pool.npz"))))
    os.makedirs(os.path.join(workdir, "data_cache"), exist_ok=True)
    open(os.path.join(workdir, "data_cache", "pool.npz"), "w").close()
    with open(state, "w") as f:
      f.write(f"lr={config.lr}")
    if config.steps == 99:
      raise KeyboardInterrupt  # killed half-way
    return [dict(value=config.lr)]
  monkeypatch.setattr(sys.modules[f"spec_jax.programs.{PROGRAM}"], "run", resuming)

  def run(lr, steps=10, inputs=None):
    config = get_config()
    config.update(lr=lr, steps=steps)
    return [experiment.Run("train", config, inputs=inputs or {})]
  with pytest.raises(KeyboardInterrupt):
    experiment.run_all(top, str(tmp_path), run(0.1, steps=99))
  with pytest.raises(KeyboardInterrupt):
    experiment.run_all(top, str(tmp_path), run(0.1, steps=99))   # the same setting: resumed
  experiment.run_all(top, str(tmp_path), run(0.2))                # another: from nothing
  experiment.run_all(top, str(tmp_path), run(0.2, inputs={"drafter": "rebuilt"}))
  assert seen == [(None, False), ("lr=0.1", True), (None, True), (None, True)]
  previous = tmp_path / "runs" / "train.previous"
  assert (previous / "state.txt").read_text() == "lr=0.2" and not (previous / "data_cache").exists()
  assert json.load(open(tmp_path / "runs" / "train" / "started.json")) == experiment.identity(
      run(0.2, inputs={"drafter": "rebuilt"})[0])


def test_render_only_runs_nothing_and_lists_the_missing_runs(fake_program, tmp_path,
                                                             monkeypatch):
  get_config, _ = fake_program
  workdir = str(tmp_path)
  experiment.run_all(ml_collections.ConfigDict(dict(render_only=False)), workdir,
                     _runs(get_config, (0.1,)))
  # A committed run without config.json (no digest): read back under render_only only.
  committed = tmp_path / "runs" / "old"
  committed.mkdir(parents=True)
  (committed / "results.json").write_text(json.dumps([dict(value=7.0)]))
  monkeypatch.setattr(sys.modules[f"spec_jax.programs.{PROGRAM}"], "run", _refuse)

  def runs():
    yield from _runs(get_config, (0.1, 0.3))
    config = get_config()
    config.lr = 9.0  # another digest than lr0.1's saved one: read back all the same
    yield experiment.Run("old", config)
  got = experiment.run_all(ml_collections.ConfigDict(dict(render_only=True)), workdir, runs())
  assert got.missing == ["lr0.3"] and not os.path.exists(tmp_path / "runs" / "lr0.3")
  assert [r["run"] for r in got.rows] == ["lr0.1", "old"] and got.rows[1]["value"] == 7.0
  assert "lr0.3" not in got.by_run
  # Without render_only the run without a digest runs again.
  monkeypatch.setattr(sys.modules[f"spec_jax.programs.{PROGRAM}"], "run",
                      lambda c, d: [dict(value=8.0)])
  fresh = experiment.run_all(ml_collections.ConfigDict(dict(render_only=False)), workdir,
                             [experiment.Run("old", get_config())])
  assert fresh.rows == [dict(value=8.0, run="old")]


def test_a_generator_gets_each_runs_rows(fake_program, tmp_path):
  """A later run built from an earlier one's output (a trained checkpoint's path), with a fn of
  its own; a dict result is one row. Under render_only the generator gets [] for a missing run."""
  get_config, calls = fake_program

  def train(config, directory):
    return dict(checkpoint=os.path.join(directory, "ckpt"), steps=config.steps)

  def runs(config, workdir):
    trained = yield experiment.Run("train", get_config(), fn=train)
    evaluate = get_config()
    evaluate.model.checkpoint = trained[0]["checkpoint"] if trained else "untrained"
    yield experiment.Run("eval", evaluate, tags=dict(kind="eval"))

  top = ml_collections.ConfigDict(dict(render_only=True))
  got = experiment.run_all(top, str(tmp_path), runs(top, str(tmp_path)))
  assert got.missing == ["train", "eval"] and not calls
  top.render_only = False
  got = experiment.run_all(top, str(tmp_path), runs(top, str(tmp_path)))
  ckpt = os.path.join(str(tmp_path), "runs", "train", "ckpt")
  assert got.by_run["train"] == [dict(checkpoint=ckpt, steps=10, run="train")]
  assert calls[0][0]["model"]["checkpoint"] == ckpt
  assert got.rows[-1] == dict(value=1.0, kind="eval", run="eval")


def test_two_runs_with_one_name_are_refused(fake_program, tmp_path):
  get_config, calls = fake_program
  with pytest.raises(ValueError, match="Two runs are named 'lr0.1'"):
    experiment.run_all(ml_collections.ConfigDict(dict(render_only=False)), str(tmp_path),
                       [*_runs(get_config, (0.1,)), *_runs(get_config, (0.1,))])


def test_carried_rows(tmp_path):
  old = tmp_path / "results.json"
  old.write_text(json.dumps([dict(setting="a", v=1), dict(setting="a", v=2),
                             dict(setting="b", v=3), dict(other="no setting")]))
  key = lambda r: r["setting"]  # noqa: E731
  config = ml_collections.ConfigDict(dict(carry=(), carry_from=""))
  assert experiment.carried_rows(config, key) == {}
  config.carry, config.carry_from = ("a",), str(old)
  assert experiment.carried_rows(config, key) == {
      "a": [dict(setting="a", v=1, carried=True), dict(setting="a", v=2, carried=True)]}
  config.carry = ("a", "c")
  with pytest.raises(ValueError, match=r"carry has \['c'\], but carry_from=.* holds no rows"):
    experiment.carried_rows(config, key)
  config.carry_from = str(tmp_path / "missing.json")
  with pytest.raises(ValueError, match=r"carry=\['a', 'c'\] takes rows from carry_from=.*"
                                       "which is not a file"):
    experiment.carried_rows(config, key)
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  config.carry_from = str(bad)
  with pytest.raises(ValueError, match="carry_from=.* is not a readable results.json"):
    experiment.carried_rows(config, key)


def test_write_outputs(tmp_path):
  drawn = []
  report = experiment.Report(markdown="# title\n", plots={"p.png": drawn.append},
                             extra_json={"extra.json": {"a": [1, 2]}})
  experiment.write_outputs(str(tmp_path), [dict(v=1)], report)
  assert json.load(open(tmp_path / "results.json")) == [dict(v=1)]
  assert (tmp_path / "results.md").read_text() == "# title\n"
  assert json.load(open(tmp_path / "extra.json")) == {"a": [1, 2]}
  assert drawn == [str(tmp_path / "p.png")]
  # No rows (render_only before anything finished): the report, but nothing to plot.
  experiment.write_outputs(str(tmp_path / "empty"), [], report)
  assert json.load(open(tmp_path / "empty" / "results.json")) == []
  assert os.path.exists(tmp_path / "empty" / "results.md") and len(drawn) == 1


def test_errorbar_plot_writes_a_png(tmp_path):
  series = {"sd": ([4, 2], [1.4, 1.3], [0.02, None]), "rsd_s": ([2, 4], [1.5, 1.6], [0.1, 0.1])}
  experiment.errorbar_plot(str(tmp_path / "lines.png"), series, xlabel="L", ylabel="τ",
                           title="t", style=lambda label: dict(marker="o"), hline=1.0,
                           hline_label="autoregressive")
  panels = {("in", "a"): ([4, 8], [0.3, 0.4], [0.01, 0.02]), ("out", "b"): ([4], [0.1], [0.0])}
  experiment.errorbar_plot(str(tmp_path / "bars.png"), panels, xlabel="γ", ylabel="τ − 1",
                           title="t", bars=True)
  experiment.errorbar_plot(str(tmp_path / "empty.png"), {}, xlabel="x", ylabel="y", title="t")
  for name in ("lines.png", "bars.png", "empty.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_experiment_checks_first_and_writes_the_report(fake_program, tmp_path):
  get_config, calls = fake_program
  config = ml_collections.ConfigDict(dict(render_only=False, config_file="x.py"))
  workdir = str(tmp_path / "w")

  def bad(config, workdir):
    raise ValueError("lr=-1 must be > 0. Fix: --config.lr=0.1")
  with pytest.raises(ValueError, match="lr=-1"):
    experiment.run_experiment(config, workdir, runs=lambda c, w: _runs(get_config, (0.1,)),
                              report=_refuse, check=bad)
  assert not os.path.exists(workdir) and not calls

  def report(config, collected, command):
    assert command.startswith("python launch.py")
    return experiment.Report(markdown=f"{len(collected.rows)} rows\n",
                             rows=[r for r in collected.rows if r["run"] == "lr0.2"])
  rows = experiment.run_experiment(config, workdir, report=report,
                                   runs=lambda c, w: _runs(get_config, (0.1, 0.2)))
  assert rows == [dict(value=2.0, part="a", run="lr0.2")]
  assert json.load(open(os.path.join(workdir, "results.json"))) == rows
  assert open(os.path.join(workdir, "results.md")).read() == "2 rows\n"
