"""Reports: glossary, markdown tables, plots and result files; hand-made rows, no model."""

import json
import os

import pytest

from spec_jax.evaluation import glossary, plots, report, tables

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _row(method, gamma, temperature=0.0, batch_size=1, alpha=0.6, **extra):
  """A plausible row: τ from the i.i.d. chain formula, speedup from τ/(r(M)+γc) with c = 0.1
  and r(M) = 1 + 0.1γ."""
  if gamma:
    tau = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    r_m = 1 + 0.1 * gamma
    theory = tau / (r_m + 0.1 * gamma)
    row = dict(method=method, gamma=gamma, temperature=temperature, batch_size=batch_size,
               block_efficiency=tau, mean_accepted_tokens=tau - 1, acceptance_rate=alpha,
               empirical_acceptance=alpha - 0.01,
               per_position_acceptance=[alpha + 0.1 - 0.05 * i for i in range(gamma)],
               tokens_per_s=40.0 * theory * 0.9, speedup=theory * 0.9, cost_ratio_c=0.1,
               verifier_cost_ratio_r=r_m, theoretical_speedup=theory, speedup_vs_theory=0.9,
               verifier_tokens_per_call=gamma + 1, tau_se=0.05)
  else:
    row = dict(method=method, gamma=None, temperature=temperature, batch_size=batch_size,
               block_efficiency=1.0, mean_accepted_tokens=0.0, acceptance_rate=None,
               empirical_acceptance=None, per_position_acceptance=None, tokens_per_s=40.0,
               speedup=1.0, cost_ratio_c=None, verifier_cost_ratio_r=1.0,
               theoretical_speedup=None, speedup_vs_theory=None, verifier_tokens_per_call=1)
  row.update(top_k=0, top_p=1.0, num_prompts=8, seed=0)
  row.update(extra)
  return row


def _grid(devices=None):
  rows = []
  for temperature in (0.0, 1.0):
    for batch_size in (1, 4):
      rows.append(_row("autoregressive", None, temperature, batch_size))
      for gamma in (2, 4, 6):
        rows.append(_row("sd", gamma, temperature, batch_size, alpha=0.7 - 0.2 * temperature))
  if devices:
    for row in rows:
      row["device"] = devices
  return rows


def _table_lines(table):
  return [line for line in table.splitlines() if line.startswith("|")]


def test_glossary_theory_and_new_entries():
  # The theory is the measured-r(M) one of docs/design.md §3, not the constant-cost τ/(γc+1).
  assert "τ/(r(M) + d·c)" in glossary.GLOSSARY["theoretical_speedup"]
  assert "γc+1" not in glossary.GLOSSARY["theoretical_speedup"]
  assert "measured" in glossary.GLOSSARY["verifier_cost_ratio_r"]
  assert "candidates_per_call" in glossary.GLOSSARY
  assert glossary.column_label("verifier_cost_ratio_r") == "verifier_cost_ratio_r (r(M))"
  assert glossary.column_label("block_efficiency") == "block_efficiency (τ)"
  assert glossary.column_label("new_tokens") == "new_tokens"
  # Printed in glossary order, whatever order the keys come in; unknown keys skipped.
  assert glossary.markdown_lines(["speedup", "gamma", "not_a_metric"]) == [
      f"- **gamma**: {glossary.GLOSSARY['gamma']}",
      f"- **speedup**: {glossary.GLOSSARY['speedup']}"]


def test_format_value():
  assert tables.format_value(None) == "–"
  assert tables.format_value([0.712, 0.618, 0.5549]) == "0.71/0.62/0.55"
  assert tables.format_value([1, 8, 8]) == "1/8/8"  # counts (a tree's call widths) stay whole
  assert tables.format_value(2.3456) == "2.35"
  assert tables.format_value(12.345) == "12.3"
  assert tables.format_value(1234.56) == "1235"
  assert tables.format_value(0.0042) == "0.0042"  # a small cost ratio must not print as 0.00
  assert tables.format_value(0.6, "temperature") == "0.6"
  assert tables.format_value(4) == "4"
  assert tables.format_value("a|b") == "a\\|b"


def test_markdown_table_header_values_and_order():
  rows = [
      dict(method="sd", gamma=4, temperature=0.0, batch_size=1, block_efficiency=2.3456,
           acceptance_rate=0.612, per_position_acceptance=[0.712, 0.618, 0.5549, 0.5]),
      dict(method="autoregressive", gamma=None, temperature=0.0, batch_size=1,
           block_efficiency=1.0, acceptance_rate=None, per_position_acceptance=None),
      dict(method="sd", gamma=2, temperature=0.0, batch_size=1, block_efficiency=1.8,
           acceptance_rate=0.6, per_position_acceptance=[0.7, 0.5]),
  ]
  lines = _table_lines(tables.markdown_table(rows, method_order=["autoregressive", "sd"]))
  # Only the default columns present in the rows, in the default order, with their symbols.
  assert lines[0] == ("| method | gamma (γ) | temperature (T) | batch_size "
                      "| block_efficiency (τ) | acceptance_rate (α) | per_position_acceptance |")
  assert lines[1] == "|---|---:|---:|---:|---:|---:|---|"
  assert lines[2] == "| autoregressive | – | 0 | 1 | 1.00 | – | – |"
  assert lines[3] == "| sd | 2 | 0 | 1 | 1.80 | 0.60 | 0.70/0.50 |"
  assert lines[4] == "| sd | 4 | 0 | 1 | 2.35 | 0.61 | 0.71/0.62/0.55/0.50 |"


def test_markdown_table_sort_and_explicit_columns():
  rows = [_row("sd", 4, 1.0, 1), _row("sd", 2, 1.0, 4), _row("autoregressive", None, 1.0, 1),
          _row("sd", 2, 0.0, 4)]
  table = tables.markdown_table(rows, ["method", "gamma", "temperature", "batch_size"])
  # Method first-appearance order, then temperature, batch size, γ.
  assert _table_lines(table)[2:] == ["| sd | 2 | 0 | 4 |", "| sd | 4 | 1 | 1 |",
                                     "| sd | 2 | 1 | 4 |", "| autoregressive | – | 1 | 1 |"]
  assert tables.markdown_table([]) == "_No rows._"


def test_varying_extra_setting_gets_a_column():
  rows = [_row("sd", 4, lenience="f_lin", epsilon=0.5), _row("sd", 4, lenience="f_sq",
                                                               epsilon=0.5)]
  header = _table_lines(tables.markdown_table(rows))[0]
  assert header.startswith("| method | lenience | gamma (γ) |")
  assert "epsilon" not in header and "seed" not in header  # constant across rows


def test_group_rows_by_temperature_and_batch_size():
  groups = tables.group_rows(_grid())
  assert [tuple(values.values()) for values, _ in groups] == [(0.0, 1), (0.0, 4), (1.0, 1),
                                                              (1.0, 4)]
  for values, rows in groups:
    assert len(rows) == 4
    assert all(r["temperature"] == values["temperature"] and
               r["batch_size"] == values["batch_size"] for r in rows)
    assert [r["gamma"] for r in rows] == [None, 2, 4, 6]


def test_write_report_markdown(tmp_path):
  rows = _grid(devices="cpu (2 cores, x86_64)")
  paths = report.write_report(str(tmp_path), rows, title="SD on SmolLM2",
                              config_text="config.gamma = 4\n",
                              command="python launch.py --config configs/sd.py")
  assert set(paths) == {"markdown", "tau_vs_gamma", "speedup_vs_gamma"}
  text = open(paths["markdown"], encoding="utf-8").read()
  assert text.startswith("# SD on SmolLM2\n")
  assert "python launch.py --config configs/sd.py" in text
  assert "config.gamma = 4" in text
  assert "device = cpu (2 cores, x86_64)" in text and "num_prompts = 8" in text
  # One table per (temperature, batch_size); the group keys are in the heading, not the table.
  headings = [line for line in text.splitlines() if line.startswith("### ")]
  assert headings == ["### temperature (T) = 0, batch_size = 1",
                      "### temperature (T) = 0, batch_size = 4",
                      "### temperature (T) = 1, batch_size = 1",
                      "### temperature (T) = 1, batch_size = 4"]
  headers = [line for line in text.splitlines() if line.startswith("| method")]
  assert len(headers) == 4 and all("temperature" not in h and "batch_size" not in h
                                   for h in headers)
  # The glossary lists every column shown, with the docs/design.md §3 definitions, and nothing unused.
  printed = text.split("## Glossary")[1].split("## Config")[0]
  columns = tables.default_columns(rows)
  assert "verifier_cost_ratio_r" in columns  # r(M) stands beside the theory it enters
  for column in columns:
    assert f"- **{column}**: {glossary.GLOSSARY[column]}" in printed
  assert "**block_efficiency**: τ, block efficiency: tokens emitted per verifier call" in printed
  assert "**drafter_calls**" not in printed
  assert "![tau_vs_gamma](tau_vs_gamma.png)" in text
  assert "![speedup_vs_gamma](speedup_vs_gamma.png)" in text


def test_write_report_plots_are_pngs(tmp_path):
  paths = report.write_report(str(tmp_path), _grid(), title="t")
  for name in ("tau_vs_gamma", "speedup_vs_gamma"):
    assert paths[name] == os.path.join(str(tmp_path), f"{name}.png")
    with open(paths[name], "rb") as f:
      data = f.read()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def test_tau_plot_lines_and_subplots():
  fig = plots.plot_tau_vs_gamma(_grid(devices="NVIDIA H100 x1"))
  # One subplot per batch size; per subplot one solid line and one dashed theory line for each
  # (method, temperature) with γ > 0: sd at T=0 and T=1. Autoregressive is not a τ-vs-γ series.
  assert [ax.get_title() for ax in fig.axes] == ["batch_size = 1", "batch_size = 4"]
  assert "NVIDIA H100 x1" in fig.get_suptitle()
  # τ carries its standard error over prompts as error bars, one set per series and panel.
  assert all(len(ax.containers) == 2 for ax in fig.axes)
  # One figure legend: the series, then a single entry for all the dashed theory lines.
  legend, = fig.legends
  labels = [t.get_text() for t in legend.get_texts()]
  assert len(labels) == 3 and labels[:2] == ["sd, T=0", "sd, T=1"]
  assert labels[2].startswith("theory")
  for ax in fig.axes:
    styles = sorted(line.get_linestyle() for line in ax.get_lines()
                    if line.get_linestyle() != "None")  # error bar caps are markers only
    assert styles == ["-", "-", "--", "--"]
    assert ax.get_xlabel() == "gamma (γ): draft length"
    assert ax.get_ylabel().startswith("block_efficiency (τ)")
    solid, = [l for l in ax.get_lines() if l.get_label() == "sd, T=0"]
    assert list(solid.get_xdata()) == [2, 4, 6]
    # Rows were made with the i.i.d. formula, so the theory curve lies on the measured one.
    theory, = [l for l in ax.get_lines()
               if l.get_linestyle() == "--" and l.get_color() == solid.get_color()]
    assert list(theory.get_ydata()) == pytest.approx(list(solid.get_ydata()))


def test_a_single_gamma_is_drawn_as_bars_with_error_bars():
  rows = [r for r in _grid() if r.get("gamma") in (None, 4)]
  fig = plots.plot_tau_vs_gamma(rows)
  for ax in fig.axes:
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert len(bars) == 2  # sd at T=0 and T=1, side by side
    assert sorted(round(b.get_x() + b.get_width() / 2, 3) for b in bars) == [3.8, 4.2]
    kinds = sorted(type(c).__name__ for c in ax.containers)
    assert kinds == ["BarContainer", "BarContainer", "ErrorbarContainer", "ErrorbarContainer"]
  assert plots.plot_speedup_vs_gamma(rows) is not None


def test_tau_theory():
  assert plots.tau_theory(dict(gamma=4, acceptance_rate=0.5)) == pytest.approx(1.9375)
  assert plots.tau_theory(dict(gamma=4, acceptance_rate=1.0)) == 5.0
  assert plots.tau_theory(dict(gamma=4, acceptance_rate=None)) is None
  # A tree's row: the chain formula does not describe it, so no theory point is drawn.
  assert plots.tau_theory(dict(gamma=4, acceptance_rate=0.5, tree="rsd_s W=2 L=4")) is None
  assert plots.tau_theory(dict(gamma=4, acceptance_rate=0.5, tree=None)) == pytest.approx(1.9375)


def test_repeated_rows_at_one_gamma_get_the_standard_error_of_their_mean():
  """Two seeds' rows at one γ: the point is their mean τ and its bar √(Σ SE²) / n."""
  rows = [dict(method="sd", temperature=0.0, gamma=4, batch_size=1, block_efficiency=tau,
               tau_se=0.1, acceptance_rate=0.5, device="cpu") for tau in (2.0, 2.2)]
  fig = plots.plot_tau_vs_gamma(rows)
  (ax,) = fig.axes
  (bars,) = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
  segment = bars.lines[2][0].get_segments()[0]
  assert segment[1][1] - segment[0][1] == pytest.approx(2 * 0.1 * 2 ** 0.5 / 2)


def test_speedup_plot_has_baseline_and_theory():
  fig = plots.plot_speedup_vs_gamma([r for r in _grid() if r["batch_size"] == 4])
  ax, = fig.axes
  baseline = [l for l in ax.get_lines() if l.get_label() == "autoregressive"]
  assert len(baseline) == 1 and list(baseline[0].get_ydata()) == [1.0, 1.0]
  assert sum(l.get_linestyle() == "--" for l in ax.get_lines()) == 2
  assert [t.get_text() for t in fig.legends[0].get_texts()][-1] == "autoregressive"
  solid, = [l for l in ax.get_lines() if l.get_label() == "sd, T=0"]
  expected = [_row("sd", g, 0.0, 4, alpha=0.7)["speedup"] for g in (2, 4, 6)]
  assert list(solid.get_ydata()) == pytest.approx(expected)


def test_rows_without_gamma_skip_plots(tmp_path):
  # Autoregressive rows carry gamma None or 0; neither is a point on a γ axis.
  rows = [_row("autoregressive", None, 0.0, 1),
          dict(_row("autoregressive", None, 1.0, 1), gamma=0)]
  assert plots.plot_tau_vs_gamma(rows) is None
  paths = report.write_report(str(tmp_path), rows, title="AR only")
  assert set(paths) == {"markdown"}
  assert not os.path.exists(tmp_path / "tau_vs_gamma.png")
  text = open(paths["markdown"], encoding="utf-8").read()
  assert "`tau_vs_gamma.png` skipped: no rows with a draft length γ > 0" in text
  assert "`speedup_vs_gamma.png` skipped" in text
  # No rows at all still writes a report.
  paths = report.write_report(str(tmp_path / "empty"), [], title="nothing")
  assert "_No rows._" in open(paths["markdown"], encoding="utf-8").read()


def test_load_rows_round_trip(tmp_path, capsys):
  rows = _grid()
  report.write_results(str(tmp_path), rows)
  capsys.readouterr()
  assert report.load_rows(str(tmp_path)) == rows
  assert report.load_rows(str(tmp_path / "results.json")) == rows
  (tmp_path / "bad.json").write_text(json.dumps({"rows": rows}))
  with pytest.raises(ValueError, match="JSON list of row objects"):
    report.load_rows(str(tmp_path / "bad.json"))
