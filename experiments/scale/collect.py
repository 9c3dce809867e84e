"""Gather the speed rows of experiments/scale/{cpu,gpu}/<run>/results.json into
experiments/scale/results.json (one row per run × batch size), followed by the pod plan's rows
(plan.json: XLA:CPU's fake devices; v5e/plan.json: XLA:TPU ahead of time; one row per plan, with
`mesh` and `bytes_per_device`), and print the speed rows' markdown table.

Each row keeps the run's own roofline (parameter bytes over the read bandwidth measured in the
same turns, `timing.MemoryReads`) and, for a device kind with a reference bandwidth below, the
roofline at that bandwidth too. The reference is what a device-to-device copy reached on that kind
of machine in this workplace (the device library's KINDS.md, bytes read plus written): runs made
before `MemoryReads` spread its wait over several passes timed one 512 MiB read per call, which
on a GPU is as long as the dispatch, and under-read the bandwidth by 2-3×.

  python experiments/scale/collect.py            # rewrite results.json, print the table
"""

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
REFERENCE_GB_S = {"NVIDIA H200": 4300.0, "NVIDIA H100 80GB HBM3": 3000.0}
KEEP = ("preset", "model", "device", "device_kind", "dtype", "batch_size", "new_tokens",
        "ms_per_step", "ms_per_decode_step", "ms_per_token", "tokens_per_s",
        "roofline_ms_per_step", "vs_roofline", "decode_vs_roofline", "memory_bandwidth_gb_s",
        "throughput_vs_first_batch_size", "loop", "fused", "unrolled", "xla_flags")


def rows():
  out = []
  for path in sorted(HERE.glob("*/*/results.json")):
    for row in json.loads(path.read_text()):
      if "ms_per_step" not in row or "batch_size" not in row:
        continue  # cost_model rows: their own results.md
      kept = {k: row.get(k) for k in KEEP}
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


if __name__ == "__main__":
  gathered = rows()
  (HERE / "results.json").write_text(json.dumps(gathered + plan_rows(), indent=1) + "\n")
  sys.stdout.write(table(gathered) + "\n")
