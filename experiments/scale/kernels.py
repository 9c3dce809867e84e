"""Kernels per decode step on an NVIDIA GPU, counted on a machine without one.

A small model's decode step on a GPU is launch-bound (experiments/scale/results.md: the 135M
shape's step is ~840 kernels, each ~1.5-2 µs, against a 0.14 ms memory roofline), so the number of
kernels a step launches is the figure a layout change has to move. This compiles the benchmark's
decode program (`decoding/generate.py`, the fixed decode loop, batch 1, random-prompt shapes) for a
GPU target described by a target config (XLA's deviceless compilation: no GPU, no driver),
with the launcher's XLA defaults (`cli.XLA_DEFAULTS`), from abstract parameters, and counts the
thunks one iteration of the decode loop launches in XLA's optimized HLO: every fusion, library
call and copy, nested loops (the layer scan) times their trip counts. Cross-checked against the
HLO dumped on an H200: the same count (837 for the 135M shape in float32 under that run's flags,
Triton's GEMM fusions on). It also reads the thunk sequence XLA's runtime executes (the
compile's dump) for what the host launches a decode step: CUDA graphs (command buffers) and
launches outside them (`host_launches`). Hand-written Pallas kernels
(`model.size=...:fused=1:pallas=1`, `models/pallas_layers.py`; `:attn_kernel=1`) lower for the
target too: their Triton lowering reads the GPU's kind from an abstract mesh of that kind, and
each becomes one `__gpu$xla.gpu.triton` custom call.

  # once: the CUDA plugin of the installed jax, into a folder of its own (it needs no GPU)
  pip install --target /tmp/cuda-plugin --no-deps "jax-cuda12-plugin==$(python -c \
      'import jax; print(jax.__version__)')" "jax-cuda12-pjrt==$(python -c \
      'import jax; print(jax.__version__)')"
  PYTHONPATH=/tmp/cuda-plugin JAX_PLATFORMS=cpu python experiments/scale/kernels.py \
      smollm2-135m@float32 smollm2-135m:fused=1@float32 llama3.1-8b:fused=1:unrolled=1@bfloat16

Each run is `model.size[@dtype]` (a family size or an architecture preset with its layout
options, `draft_init.parse_size`; dtype float32 by default). XLA's fusion decisions change
between versions: the lent GPUs run jax 0.11.2 (Python 3.12), so the committed rows
(experiments/scale/kernels.json, merged by run and jax version) come from a Python 3.12
environment with jax 0.11.2 and its plugin. Prints the table for experiments/scale/results.md
and, with --layer, the kernels of one layer-loop iteration.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from spec_jax import cli  # noqa: E402  (no jax)

# Device descriptions for XLA's deviceless GPU compilation (stream_executor.GpuTargetConfigProto,
# text format). H100 SXM's figures are the ones XLA's own tests use; the H200 is the same
# sm_90 chip with its own memory (141 GB at 4.8 TB/s). The driver version matters: XLA keeps
# library calls (cuBLAS) and custom calls out of CUDA graphs under a driver older than 12.3
# (or none named), which the lent GPUs' 580 driver (CUDA 13.0) is not.
_SM90 = """
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  runtime_version: "12.9.0" driver_version: "13.0.0" compile_time_toolkit_version: "12.9.0"
}}
runtime_version {{ major: 12 minor: 9 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{name}"
"""
TARGETS = {
    "h200": _SM90.format(bandwidth=4_800_000_000_000, memory=150_000_000_000,
                         name="NVIDIA H200"),
    "h100": _SM90.format(bandwidth=3_352_320_000_000, memory=84_978_434_048,
                         name="NVIDIA H100 80GB HBM3"),
}

# Instructions that launch nothing: bookkeeping, and the halves of async pairs counted at start.
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
             "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
             "add-dependency", "domain", "copy-done", "fusion-done", "async-done", "send-done",
             "recv-done", "all-reduce-done", "all-gather-done", "collective-permute-done"}
_OP = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")
# Calls whose callee is a kernel's body, not more kernels.
_KERNEL_CALL = re.compile(r"\s(?:fusion|fusion-start|custom-call|reduce|sort|scatter|map|"
                          r"reduce-window|select-and-scatter|all-reduce|all-reduce-start|"
                          r"reduce-scatter)\(")


def kernels_per_iteration(hlo: str, trips: int) -> collections.Counter:
  """{kind: count} of the kernels one iteration of the entry's `while` of `trips` iterations runs
  (its body and condition; a nested loop's kernels times its trip count, an unknown trip count
  once). Kinds: the opcode, `fusion:<kind>` (kLoop, kInput, kCustom...), `custom-call:<target>`."""
  from spec_jax.programs import pod_plan  # noqa: PLC0415  (imports jax)
  comps, entry = pod_plan._computations(hlo)  # noqa: SLF001  (the module's HLO reader)
  loops = [line for line in comps[entry]
           if " while(" in line and pod_plan._trips(line, comps) == trips]  # noqa: SLF001
  if len(loops) != 1:
    raise RuntimeError(f"Expected one loop of {trips} iterations in the entry computation, "
                       f"found {len(loops)}.")
  count = collections.Counter()

  def visit(name: str, times: int):
    for line in comps[name]:
      op = _OP.search(line)
      if op and op.group(1) not in NO_KERNEL:
        kind = op.group(1)
        if kind.startswith("fusion"):
          sub = re.search(r"kind=(\w+)", line)
          kind = f"fusion:{sub.group(1) if sub else '?'}"
        elif kind == "custom-call":
          target = re.search(r'custom_call_target="([^"]+)"', line)
          kind = f"custom-call:{target.group(1) if target else '?'}"
        count[kind] += times
      if _KERNEL_CALL.search(line):
        continue
      for callee, n in _callees(line, comps):
        visit(callee, times * (1 if n is None else n))

  for callee, _ in _callees(loops[0], comps):
    visit(callee, 1)
  return count


_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")
# Thunks that launch nothing themselves: waits on an asynchronous launch's event.
_NO_LAUNCH = {"kAsyncDone", "kWaitForStreams"}


def _thunk_tree(lines: list[str]) -> list[tuple[int, str, list]]:
  """XLA's thunk sequence dump (`*.thunk_sequence_after_thunk_passes.txt`) as a tree of
  (indent, kind, children): a command buffer's children are the kernels its CUDA graph holds,
  a loop's are its "condition" and "body" (each with its thunks)."""
  root: list = []
  stack = [(-1, "root", root)]
  for line in lines:
    entry = _THUNK.match(line)
    if entry:
      indent, kind = len(entry.group(1)), entry.group(3)
      while stack[-1][0] >= indent:
        stack.pop()
    elif line.strip() in ("condition:", "body:"):  # of the innermost loop open above
      kind = line.strip()[:-1]
      while stack[-1][1] != "kWhile":
        stack.pop()
      indent = stack[-1][0] + 1
    else:
      continue
    node = (indent, kind, [])
    stack[-1][2].append(node)
    stack.append(node)
  return root


def host_launches(thunks: str, layer_trips: int) -> dict:
  """What the host launches for one iteration of the decode loop (the last top-level loop of
  XLA's thunk sequence `thunks`): every thunk of its body is a launch, a command buffer (one
  CUDA graph) one whatever it holds, a nested loop (the layer scan, `layer_trips` iterations,
  its condition not run: known trip count) its body's launches times its trips. Returns
  launches (graphs included), graphs, kernels_in_graphs and outside_graphs {thunk kind: n}."""
  loops = [node for node in _thunk_tree(thunks.splitlines()) if node[1] == "kWhile"]
  if not loops:
    raise RuntimeError("The thunk sequence has no loop: not a decode program's.")
  out = dict(launches=0, graphs=0, kernels_in_graphs=0, outside_graphs=collections.Counter())

  def graph_kernels(children) -> int:
    return sum(graph_kernels(c[2]) if c[2] else 1 for c in children)

  def visit(nodes, times):
    for _, kind, children in nodes:
      if kind == "kWhile":
        body = [c for c in children if c[1] == "body"]
        visit(body[0][2] if body else [], times * layer_trips)
      elif kind == "kCommandBuffer":
        out["launches"] += times
        out["graphs"] += times
        out["kernels_in_graphs"] += times * graph_kernels(children)
      elif kind not in _NO_LAUNCH:
        out["launches"] += times
        out["outside_graphs"][kind] += times

  body = [c for c in loops[-1][2] if c[1] == "body"]
  visit(body[0][2] if body else [], 1)
  out["outside_graphs"] = dict(out["outside_graphs"].most_common())
  return out


def _callees(line: str, comps: dict) -> list[tuple[str, int | None]]:
  """pod_plan's callees of an HLO line, less the condition of a loop of known trip count (the
  GPU runs such a loop without evaluating it)."""
  from spec_jax.programs import pod_plan  # noqa: PLC0415
  skip = None
  if " while(" in line and pod_plan._trips(line, comps) is not None:  # noqa: SLF001
    skip = re.search(r"condition=%([\w.\-]+)", line).group(1)
  return [(c, n) for c, n in pod_plan._callees(line, comps)  # noqa: SLF001
          if c in comps and c != skip]


def _model_config(size: str, dtype: str, vocab_size: int):
  from spec_jax.models import draft_init, families  # noqa: PLC0415
  spec = draft_init.parse_size(size, "run")
  cfg = families.model_config(spec.variant, vocab_size=vocab_size, dtype=dtype,
                              param_dtype=dtype)
  return dataclasses.replace(cfg, fused=bool(spec.fused), unrolled=bool(spec.unrolled),
                             decode_unrolled=bool(spec.decode_unrolled),
                             out_major=bool(spec.out_major), pallas=bool(spec.pallas),
                             attn_kernel=bool(spec.attn_kernel))


def decode_hlo(size: str, dtype: str, target: str, *, batch_size: int = 1,
               prompt_tokens: int = 64, new_tokens: int = 64, vocab_size: int = 49152,
               dump_to: str | None = None) -> str:
  """The optimized HLO of the benchmark's decode program (`generate._generate`, the fixed
  loop) for `target`, compiled from abstract parameters; `dump_to`: a folder for XLA's dump of
  this compile (the thunk sequence the runtime launches, `host_launches`)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415
  from spec_jax.decoding import generate  # noqa: PLC0415
  from spec_jax.decoding.sampling import Sampling  # noqa: PLC0415
  from spec_jax.models import decoder  # noqa: PLC0415
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA libraries needed
  try:
    devices = topologies.get_topology_desc(target, "cuda", target_config=TARGETS[target],
                                           topology="1x1x1").devices
  except Exception as e:  # noqa: BLE001
    raise SystemExit(f"No deviceless CUDA compiler ({str(e).splitlines()[0][:120]}). Fix: "
                     "install jax-cuda12-plugin and jax-cuda12-pjrt of this jax's version "
                     "(module docstring).") from e
  where = jax.sharding.SingleDeviceSharding(devices[0])
  cfg = _model_config(size, dtype, vocab_size)

  def abstract(shape, dtype_):
    return jax.ShapeDtypeStruct(shape, dtype_, sharding=where)

  params = jax.tree.map(lambda s: abstract(s.shape, s.dtype), decoder.param_shapes(cfg))
  # Pallas's Triton lowering (`model.size=...:pallas=1`) asks for the GPU's kind, which a
  # machine without one learns from an abstract mesh of that kind.
  kind = re.search(r'device_description_str: "([^"]+)"', TARGETS[target]).group(1)
  gpu = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=jax.sharding.AbstractDevice(
      device_kind=kind, num_cores=132, platform="cuda"))
  key_dtype = jax.random.key(0).dtype
  with jax.sharding.use_abstract_mesh(gpu):
    lowered = generate._generate_jit.trace(  # noqa: SLF001  (the benchmark's compiled program)
        params, abstract((batch_size, prompt_tokens), jnp.int32),
        abstract((batch_size,), jnp.int32), abstract((), key_dtype), cfg=cfg,
        sampling=Sampling(), max_new_tokens=new_tokens, stop_ids=(),
        fixed_steps=True).lower(lowering_platforms=("cuda",))
  return lowered.compile({"xla_dump_to": dump_to} if dump_to else None).as_text()


def layer_kernels(hlo: str, n_layers: int) -> list[str]:
  """One line per kernel of the layer loop's body (name, kind, result type): what a layer
  launches, for reading."""
  from spec_jax.programs import pod_plan  # noqa: PLC0415
  comps, _ = pod_plan._computations(hlo)  # noqa: SLF001
  for lines in comps.values():
    for line in lines:
      if " while(" in line and pod_plan._trips(line, comps) == n_layers:  # noqa: SLF001
        body = re.search(r"body=%([\w.\-]+)", line).group(1)
        return [f"{line.split(' = ')[0].strip():40s} {op.group(1):12s} "
                f"{line.split(' = ')[1].split(' ')[0][:48]}"
                for line in comps[body] if (op := _OP.search(line))
                and op.group(1) not in NO_KERNEL]
  return []


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("runs", nargs="+", help="model.size[@dtype], e.g. smollm2-135m@float32")
  parser.add_argument("--target", default="h200", choices=sorted(TARGETS))
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--layer", action="store_true", help="print one layer's kernels")
  parser.add_argument("--out", default=str(HERE / "kernels.json"))
  args = parser.parse_args(argv)
  cli.set_xla_defaults()
  import jax  # noqa: PLC0415  (after the XLA defaults)
  rows = []
  for run in args.runs:
    size, _, dtype = run.partition("@")
    dtype = dtype or "float32"
    with tempfile.TemporaryDirectory() as dump:
      hlo = decode_hlo(size, dtype, args.target, new_tokens=args.new_tokens, dump_to=dump)
      (thunks,) = pathlib.Path(dump).glob("*_generate.thunk_sequence_after_thunk_passes.txt")
      thunks = thunks.read_text()
    count = kernels_per_iteration(hlo, args.new_tokens - 1)
    n_layers = _model_config(size, dtype, 49152).n_layers
    launches = host_launches(thunks, n_layers)
    rows.append(dict(run=run, size=size, dtype=dtype, batch_size=1, target=args.target,
                     kernels_per_step=sum(count.values()),
                     kernels_per_layer=round(sum(count.values()) / n_layers, 1),
                     by_kind=dict(count.most_common()),
                     host_launches_per_step=launches["launches"],
                     graphs_per_step=launches["graphs"],
                     kernels_in_graphs=launches["kernels_in_graphs"],
                     launches_outside_graphs=launches["outside_graphs"], jax=jax.__version__,
                     xla_flags=os.environ.get("XLA_FLAGS", "")))
    print(f"{run}: {rows[-1]['kernels_per_step']} kernels a decode step "
          f"({rows[-1]['kernels_per_layer']} per layer) on {args.target}; the host launches "
          f"{launches['launches']} a step ({launches['graphs']} CUDA graphs holding "
          f"{launches['kernels_in_graphs']} kernels)", flush=True)
    if args.layer:
      print("\n".join("    " + line for line in layer_kernels(hlo, n_layers)))
  out = pathlib.Path(args.out)
  old = json.loads(out.read_text()) if out.exists() else []
  keys = {(r["run"], r["target"], r["jax"]) for r in rows}
  merged = [r for r in old if (r["run"], r["target"], r["jax"]) not in keys] + rows
  out.write_text(json.dumps(merged, indent=1) + "\n")
  print("\n| run | target | jax | kernels a step | per layer | host launches a step | CUDA graphs "
        "|\n|---|---|---|---:|---:|---:|---:|")
  for r in merged:
    print(f"| {r['run']} | {r['target']} | {r['jax']} | {r['kernels_per_step']} | "
          f"{r['kernels_per_layer']} | {r.get('host_launches_per_step', '')} | "
          f"{r.get('graphs_per_step', '')} |")
  return rows


if __name__ == "__main__":
  main()
