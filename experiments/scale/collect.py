"""Gather the speed rows of experiments/scale/{cpu,gpu}/<run>/results.json into
experiments/scale/results.json (one row per run × batch size), followed by the pod plan's rows
(plan.json: XLA:CPU's fake devices; v5e/plan.json: XLA:TPU ahead of time; one row per plan, with
`mesh` and `bytes_per_device`), and print the speed rows' markdown tables: first, per device
kind, the fastest run of each shape, dtype and batch size (`fastest_rows`), then every row.

Each row keeps the run's own roofline (parameter bytes over the read bandwidth measured in the
same turns, `timing.MemoryReads`) and, for a device kind with a reference bandwidth below, the
roofline at that bandwidth too. The reference is what a device-to-device copy reached on that kind
of machine in this workplace (the device library's KINDS.md, bytes read plus written): runs made
before `MemoryReads` spread its wait over several passes timed one 512 MiB read per call, which
on a GPU is as long as the dispatch, and under-read the bandwidth by 2-3×.

Then it draws the rows: step_vs_roofline.png, each run's decode step over its roofline (a
GPU's at the reference bandwidth) by batch size, one panel per device kind, the runs repeated in
another process (`-r2`, `-r3`, `-repeat`) drawn as their median with the range as error bars;
and r_of_t.png, r(T) of every cost run (`*-cost*/`), with each T's fastest and slowest call over
the median at T = 1 as error bars where the rows record them (`ms_min`, `ms_max`).

Last it prints what the measured τ would buy at each size: for every cost run (and each timing of
a forward_dispatch run) at batch 1, r(γ + 1) and c, the break-even τ r(γ + 1) + γ·c, the τ that
1.5× needs, and the theoretical speedup at each τ of configs/scale.py's SUITE_TAU.

  python experiments/scale/collect.py   # rewrite results.json and the plots, print the tables
"""

import json
import pathlib
import re
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from spec_jax.evaluation import plots  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
REFERENCE_GB_S = {"NVIDIA H200": 4300.0, "NVIDIA H100 80GB HBM3": 3000.0}
KEEP = ("preset", "model", "device", "device_kind", "dtype", "batch_size", "new_tokens",
        "ms_per_step", "ms_per_decode_step", "ms_per_token", "tokens_per_s",
        "roofline_ms_per_step", "vs_roofline", "decode_vs_roofline", "memory_bandwidth_gb_s",
        "throughput_vs_first_batch_size", "loop", "fused", "unrolled", "decode_unrolled",
        "out_major", "xla_flags")
# Carried only where a run recorded them (`benchmark.timings`, its timings and the slowest one's
# reference over the kept one's), so that rows from before them stay as they were.
KEEP_IF_RECORDED = ("timings", "reference_spread")


def rows():
  out = []
  for path in sorted(HERE.glob("*/*/results.json")):
    if path.parent.name.startswith("pallas-"):
      continue  # the tile sweeps (pallas_tiles.py): several layouts a process, own results.md
    for row in json.loads(path.read_text()):
      if "ms_per_step" not in row or "batch_size" not in row:
        continue  # cost_model rows: their own results.md
      kept = {k: row.get(k) for k in KEEP}
      kept.update({k: row[k] for k in KEEP_IF_RECORDED if k in row})
      kept["run"] = f"{path.parent.parent.name}/{path.parent.name}"
      ref = REFERENCE_GB_S.get(row.get("device_kind"))
      if ref:
        param_bytes = row["roofline_ms_per_step"] * 1e-3 * row["memory_bandwidth_gb_s"] * 1e9
        roof = 1e3 * param_bytes / (ref * 1e9)
        kept.update(reference_bandwidth_gb_s=ref, reference_roofline_ms_per_step=round(roof, 4),
                    decode_vs_reference_roofline=round(row["ms_per_decode_step"] / roof, 2))
      out.append(kept)
  return out


PLAN_KEEP = ("preset", "device", "dtype", "batch_size", "mesh", "devices", "context",
             "bytes_per_device", "gib_per_device", "weights_per_device", "caches_per_device",
             "fits_v5e", "fits_h100", "compiled_on")


def plan_rows():
  """The pod plan's rows (`spec_jax/programs/pod_plan.py`), the device kind as JAX names it."""
  out = []
  for path in (HERE / "plan.json", HERE / "v5e" / "plan.json"):
    for row in json.loads(path.read_text()):
      kept = {k: row.get(k) for k in PLAN_KEEP}
      kept.update(device_kind=row["device"], round_estimate_ms=row["estimate"],
                  run=str(path.relative_to(HERE).parent / "plan"))
      out.append(kept)
  return out


def table(rows):
  lines = ["| run | dtype | batch | decode ms/step | tokens/s | read GB/s (run) | × run roofline "
           "| × roofline at reference | batch / batch 1 throughput |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    ref = r.get("decode_vs_reference_roofline")
    lines.append(
        f"| {r['run'].split('/', 1)[1]} | {r['dtype']} | {r['batch_size']} | "
        f"{r['ms_per_decode_step']:.2f} | {r['tokens_per_s']:,.0f} | "
        f"{r['memory_bandwidth_gb_s']:,.0f} | {r['decode_vs_roofline']:.2f} | "
        f"{'' if ref is None else f'{ref:.2f}'} | {r['throughput_vs_first_batch_size']:.1f} |")
  return "\n".join(lines)


def _figure(ncols: int):
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
  from matplotlib.figure import Figure  # noqa: PLC0415
  fig = Figure(figsize=(6.5 * ncols, 4.8), layout="constrained")
  FigureCanvasAgg(fig)
  return fig, fig.subplots(1, ncols, squeeze=False).ravel()


def _ratio(row: dict) -> float:
  ref = row.get("decode_vs_reference_roofline")
  return ref if ref is not None else row["decode_vs_roofline"]


def _base(run: str) -> str:
  """A run without its repeat suffix: `-r2`, `-r3`, `-repeat` are the same command run again in
  another process."""
  return re.sub(r"-(r\d+|repeat)$", "", run)


def step_groups(speed_rows: list[dict]) -> dict[str, dict[tuple[str, int], list[float]]]:
  """{device_kind: {(run without its repeat suffix, batch size): [decode step / roofline]}};
  a run is `<directory>/<name>` (gpu/ holds the Triton-GEMM runs, gpu_levers/ the levers)."""
  out: dict[str, dict[tuple[str, int], list[float]]] = {}
  for r in speed_rows:
    out.setdefault(r["device_kind"], {}).setdefault((_base(r["run"]), r["batch_size"]),
                                                    []).append(_ratio(r))
  return out


def fastest_rows(speed_rows: list[dict]) -> list[dict]:
  """Per device kind, shape, dtype and batch size, the run whose decode step is fastest: a run
  and its repeats in other processes pooled, their median compared (one fast repeat does not
  win), with the range and count of its repeats, its layout (the model's `:flag=1` options,
  `default` without), its step over the roofline (at the device kind's reference bandwidth where
  there is one, else the run's own read) and how many runs of that shape were compared."""
  groups: dict[tuple, dict[str, list[dict]]] = {}
  for r in speed_rows:
    shape = (r.get("model") or r["preset"]).split(":")[0]
    key = (r["device_kind"], shape, r["dtype"], r["batch_size"])
    groups.setdefault(key, {}).setdefault(_base(r["run"]), []).append(r)
  # Shapes in order of size: the parameters a step reads (bytes over the dtype's width).
  size: dict[str, float] = {}
  for (_, shape, dtype, _), runs in groups.items():
    for r in (r for rs in runs.values() for r in rs):
      read = r["roofline_ms_per_step"] * r["memory_bandwidth_gb_s"] * 1e6
      width = 2 if dtype in ("bfloat16", "float16") else 4
      size[shape] = max(size.get(shape, 0.0), read / width)
  out = []
  for (kind, shape, dtype, batch), runs in sorted(
      groups.items(), key=lambda kv: (kv[0][0], size[kv[0][1]], *kv[0][1:])):
    median = {run: statistics.median(r["ms_per_decode_step"] for r in rs)
              for run, rs in runs.items()}
    run = min(median, key=median.get)
    steps = [r["ms_per_decode_step"] for r in runs[run]]
    layout = [opt.split("=")[0] for opt in (runs[run][0].get("model") or "").split(":")[1:]]
    out.append(dict(
        device_kind=kind, shape=shape, dtype=dtype, batch_size=batch, run=run,
        layout=", ".join(layout) or "default", repeats=len(steps),
        ms_per_decode_step=round(median[run], 3), ms_min=min(steps), ms_max=max(steps),
        tokens_per_s=round(1e3 * batch / median[run], 1),
        vs_roofline=round(statistics.median(map(_ratio, runs[run])), 2),
        roofline_at=(f"{REFERENCE_GB_S[kind]:,.0f} GB/s" if kind in REFERENCE_GB_S
                     else "the run's read"),
        runs_compared=len(runs)))
  return out


def fastest_tables(rows: list[dict]) -> str:
  """fastest_rows as markdown, one table per device kind."""
  parts = []
  for kind in dict.fromkeys(r["device_kind"] for r in rows):
    mine = [r for r in rows if r["device_kind"] == kind]
    parts.append("\n".join([
        f"**{kind}** (× roofline at {mine[0]['roofline_at']}):", "",
        "| shape | dtype | batch | fastest run | layout | decode ms/step (median; range over "
        "repeats) | × roofline | tokens/s | runs compared |",
        "|---|---|---:|---|---|---:|---:|---:|---:|",
        *(f"| {r['shape']} | {r['dtype']} | {r['batch_size']} | {r['run']} | {r['layout']} | "
          f"{r['ms_per_decode_step']:,.2f}"
          + (f" ({r['ms_min']:,.2f}–{r['ms_max']:,.2f}, {r['repeats']} runs)"
             if r["repeats"] > 1 else "")
          + f" | {r['vs_roofline']:.2f} | {r['tokens_per_s']:,.1f} | {r['runs_compared']} |"
          for r in mine)]))
  return "\n\n".join(parts)


def plot_steps(speed_rows: list[dict], path: pathlib.Path) -> None:
  from matplotlib.ticker import ScalarFormatter  # noqa: PLC0415
  groups = step_groups(speed_rows)
  fig, axes = _figure(len(groups))
  for ax, (kind, by_run) in zip(axes, sorted(groups.items())):
    runs = list(dict.fromkeys(run for run, _ in by_run))
    batches = sorted({b for _, b in by_run})
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
      xs, ys, lo, hi = [], [], [], []
      for x, run in enumerate(runs):
        values = by_run.get((run, b))
        if values:
          mid = statistics.median(values)
          xs.append(x + (i - (len(batches) - 1) / 2) * width)
          ys.append(mid)
          lo.append(mid - min(values))
          hi.append(max(values) - mid)
      ax.bar(xs, ys, width, color=f"C{i}", label=f"batch {b}")
      ax.errorbar(xs, ys, yerr=[lo, hi], fmt="none", capsize=2, ecolor="black")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="y", which="both", labelsize=7)
    ax.set_xticks(range(len(runs)), runs, rotation=60, ha="right", fontsize=7)
    reference = (f"at {REFERENCE_GB_S[kind]:,.0f} GB/s" if kind in REFERENCE_GB_S
                 else "at the run's bandwidth")
    ax.set_ylabel(f"decode step / roofline {reference}")
    ax.set_title(f"{kind}: AR decode step vs roofline (error bars: range over repeat runs)",
                 fontsize=9)
    ax.legend(fontsize=7)
  fig.savefig(path, dpi=120)


# The CPU cost runs r_of_t.png draws, one per preset, each in its fastest layout (the newest
# runs, the launcher's defaults); the others are in their own results.md. Every accelerator's
# cost runs are drawn.
CPU_CURVES = ("smollm2-135m-cost-trees", "qwen3-0.6b-cost-fused-unrolled-trees",
              "gemma3-1b-cost-fused-unrolled-trees", "llama3.2-1b-cost-fused-unrolled-trees",
              "qwen3-1.7b-cost-fused-unrolled-trees", "llama3.2-3b-cost-trees")


def cost_curves() -> dict[str, list[dict]]:
  """{run: verifier rows of r(T)} of the cost runs r_of_t.png draws (CPU_CURVES, and every run
  of another device), device kind first in the run's name."""
  out = {}
  for path in sorted(HERE.glob("*/*-cost*/results.json")):
    if path.parent.parent.name == "cpu" and path.parent.name not in CPU_CURVES:
      continue
    rows = [r for r in json.loads(path.read_text()) if r.get("model") == "verifier"
            and r.get("batch_size") == 1]
    if rows:
      out[f"{path.parent.parent.name}/{path.parent.name}"] = sorted(rows, key=lambda r: r["T"])
  return out


def theory_rows(root: pathlib.Path = HERE) -> list[dict]:
  """One row per drafter of each cost run (`*/*-cost*/`; runs without a drafter's `vocab` timed
  its whole vocabulary) and per timing of a dispatch run (`*/*-dispatch*/`), at batch 1: the
  theory at configs/scale.py's SUITE_TAU recomputed from the run's r(γ + 1) and c."""
  from configs import scale  # noqa: PLC0415
  from spec_jax.evaluation import metrics  # noqa: PLC0415
  gamma = scale.SUITE_TAU[0][0]
  taus = [tau for g, tau in scale.SUITE_TAU if g == gamma]
  out = []
  paths = [*root.glob("*/*-cost*/results.json"), *root.glob("*/*-dispatch*/results.json")]
  for path in sorted(paths):
    runs = json.loads(path.read_text())
    first = runs[0]
    for timing in dict.fromkeys(r.get("timing") for r in runs):
      ones = [r for r in runs if r.get("timing") == timing and r.get("batch_size", 1) == 1
              and r["model"] in ("verifier", "drafter")]
      verifier = {r["T"]: r["ms"] for r in ones if r["model"] == "verifier"}
      if gamma + 1 not in verifier:
        continue
      r_m = verifier[gamma + 1] / verifier[1]
      for drafter in (r for r in ones if r["model"] == "drafter" and r["T"] == 1):
        c = drafter["ms"] / verifier[1]
        out.append(dict(
            run=f"{path.parent.parent.name}/{path.parent.name}", timing=timing,
            device_kind=first.get("device_kind"), dtype=first.get("dtype"), gamma=gamma,
            vocab=drafter.get("vocab"), verifier_ms=verifier[1], r=round(r_m, 3),
            c=round(c, 4),
            break_even_tau=round(metrics.break_even_tau(r_m=r_m, c=c, drafter_calls=gamma), 3),
            theory={tau: round(metrics.theoretical_speedup(tau, r_m=r_m, c=c,
                                                           drafter_calls=gamma), 3)
                    for tau in taus}))
  return out


def theory_table(rows: list[dict]) -> str:
  taus = list(rows[0]["theory"]) if rows else []
  gamma = rows[0]["gamma"] if rows else 0
  lines = [f"| run | device | dtype | verifier T = 1 ms | r({gamma + 1}) | drafter vocabulary | "
           "c | break-even τ | τ for 1.5× | "
           + " | ".join(f"theory at τ = {t}" for t in taus) + " |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(taus)]
  for r in rows:
    run = r["run"] + (f" ({r['timing']})" if r["timing"] else "")
    vocab = "all" if r["vocab"] is None else f"{r['vocab']:,}"
    lines.append(f"| {run} | {r['device_kind']} | {r['dtype']} | {r['verifier_ms']:.2f} | "
                 f"{r['r']:.2f} | {vocab} | {r['c']:.3f} | {r['break_even_tau']:.2f} | "
                 f"{1.5 * r['break_even_tau']:.2f} | "
                 + " | ".join(f"{r['theory'][t]:.2f}×" for t in taus) + " |")
  return "\n".join(lines)


def tree_theory_rows(root: pathlib.Path = HERE) -> list[dict]:
  """One row per tree of configs/scale.py's SUITE_TREE_TAU and drafter vocabulary of each cost
  run (`*/*-cost*/`) that timed the verifier on the tree's tokens per call and the drafter on
  each call's tokens, at batch 1: the tree's theory and the chain's beside it, recomputed."""
  from configs import scale  # noqa: PLC0415
  from spec_jax.decoding import methods  # noqa: PLC0415
  out = []
  for path in sorted(root.glob("*/*-cost*/results.json")):
    runs = [r for r in json.loads(path.read_text()) if r.get("batch_size", 1) == 1]
    verifier = {r["T"]: r["ms"] for r in runs if r["model"] == "verifier"}
    drafter = {(r.get("vocab"), r["T"]): r["ms"] for r in runs if r["model"] == "drafter"}
    for entry, tau, chain_tau in scale.SUITE_TREE_TAU:
      spec = methods.parse(entry, None, field="SUITE_TREE_TAU").shape
      m, depth = spec.num_nodes, spec.depth
      for vocab in dict.fromkeys(v for v, _ in drafter):
        if ({1, m, depth + 1} - set(verifier)
            or any((vocab, w) not in drafter for w in spec.call_widths)):
          continue
        r, chain_r = verifier[m] / verifier[1], verifier[depth + 1] / verifier[1]
        drafting = sum(drafter[vocab, w] for w in spec.call_widths) / verifier[1]
        c = drafter[vocab, 1] / verifier[1]
        tree, chain = tau / (r + drafting), chain_tau / (chain_r + depth * c)
        out.append(dict(
            run=f"{path.parent.parent.name}/{path.parent.name}", method=entry,
            device_kind=runs[0].get("device_kind"), dtype=runs[0].get("dtype"), vocab=vocab,
            verifier_ms=verifier[1], tokens=m, r=round(r, 3), drafter_c=round(drafting, 4),
            tau=tau, theory=round(tree, 3), break_even_tau=round(r + drafting, 3),
            chain_tau=chain_tau, chain_r=round(chain_r, 3), c=round(c, 4),
            chain_theory=round(chain, 3), vs_chain=round(tree / chain, 3)))
  return out


def tree_theory_table(rows: list[dict]) -> str:
  lines = ["| run | device | dtype | tree | drafter vocabulary | r(M) | Σ c(w) | theory at τ | "
           "break-even τ | chain: r(L + 1) | c | theory at τ | tree / chain |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    vocab = "all" if r["vocab"] is None else f"{r['vocab']:,}"
    lines.append(f"| {r['run']} | {r['device_kind']} | {r['dtype']} | {r['method']} (M = "
                 f"{r['tokens']}) | {vocab} | {r['r']:.2f} | {r['drafter_c']:.3f} | "
                 f"{r['theory']:.2f}× ({r['tau']}) | {r['break_even_tau']:.2f} | "
                 f"{r['chain_r']:.2f} | {r['c']:.3f} | {r['chain_theory']:.2f}× "
                 f"({r['chain_tau']}) | {r['vs_chain']:.2f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  gathered = rows()
  (HERE / "results.json").write_text(json.dumps(gathered + plan_rows(), indent=1) + "\n")
  plot_steps(gathered, HERE / "step_vs_roofline.png")
  curves = {f"{run} ({rows[0]['device_kind']}, {rows[0]['dtype']})": rows
            for run, rows in cost_curves().items()}
  plots.plot_r_of_t(curves, "r(T) at batch 1, medians (error bars: the fastest and slowest call "
                    "over the median at T = 1, where recorded)").savefig(HERE / "r_of_t.png",
                                                                         dpi=120)
  sys.stdout.write(fastest_tables(fastest_rows(gathered)) + "\n\n" + table(gathered) + "\n\n"
                   + theory_table(theory_rows()) + "\n\n"
                   + tree_theory_table(tree_theory_rows()) + "\n")
