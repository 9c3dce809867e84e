"""Program `pod_plan`: does speculative decoding of a large verifier fit a pod slice, and what does
a round cost there? Compiled ahead of time from abstract parameters: nothing is allocated.

Each plan `PRESET:DATAxFSDPxTENSOR` (`plan.plans`): the preset (`models/presets.py`) verifies, its
one-block feature drafter (`presets.block_drafter`) drafts, both in `plan.dtype` and sharded as
decoding shards them (`parallel.py`). The jitted speculative generate call (prefill, then the
`while_loop` of rounds: `decoding/loop.py`) compiles for JAX's devices (a real slice, or fake CPU
ones) or, with `plan.topology` ('v5e:8x8'), for a TPU slice through libtpu on any machine. Rows
(plan.json, plan.md): bytes_per_device from the compiled memory analysis, against v5e and H100 HBM
(`CHIPS`; XLA:CPU, with no bfloat16 matmul, keeps float32 weight copies and overstates it);
weights_per_device + caches_per_device, by hand, its floor; collectives per round (the loop body,
nested loops times their trip counts): count, bytes per device and the largest one's bytes;
estimate per chip: hbm_ms (bytes a round reads per device: verifier weights and cache once, the
drafter's γ times; an untied input embedding's gathered rows aside, `timing.decode_read_bytes`) + ici_ms (all-reduce bytes; ici_all_ms: every collective's) over the
bandwidths, an estimate.
`plan.must_fit` (a chip) makes a plan that does not fit an error.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import time

import jax
import jax.numpy as jnp

from spec_jax import checks, parallel
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import features, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.evaluation import timing
from spec_jax.models import decoder, presets


Chip = collections.namedtuple("Chip", "hbm_bytes hbm_bytes_per_s ici_bytes_per_s source")
GIB = 2**30
CHIPS = {  # HBM capacity and bandwidth, inter-chip bandwidth per chip, and their source
    "v5e": Chip(16 * GIB, 819e9, 200e9, "Google Cloud TPU v5e documentation: 16 GiB HBM2 at "
                "819 GB/s, inter-chip interconnect 1,600 Gbps per chip"),
    "h100": Chip(81559 * 2**20, 3.35e12, 450e9, "NVIDIA H100 SXM5 datasheet: HBM3 at 3.35 TB/s, "
                 "NVLink 900 GB/s (450 each way); 81,559 MiB as nvidia-smi reads an 80GB HBM3")}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def parse_plan(spec: str, field: str = "plan.plans") -> tuple[str, dict]:
  """'llama3.1-70b:1x8x8' -> (preset, {data, fsdp, tensor}); ValueError naming `field`."""
  name, _, sizes = spec.partition(":")
  try:
    data, fsdp, tensor = (int(s) for s in sizes.split("x"))
    if min(data, fsdp, tensor) < 1:
      raise ValueError
  except ValueError:
    raise ValueError(f"{field} entry {spec!r} is not PRESET:DATAxFSDPxTENSOR with sizes >= 1, "
                     "e.g. 'llama3.1-70b:1x8x8'.") from None
  presets.get(name, field)
  return name, dict(data=data, fsdp=fsdp, tensor=tensor)


def check_plan(spec: str, sizes: dict, v_cfg, p, num_devices: int) -> None:
  """Every check of a plan that needs no compile (ValueError: one line naming the field)."""
  if (need := math.prod(sizes.values())) > num_devices:
    raise ValueError(f"plan.plans entry {spec!r} needs {need} devices but there are "
                     f"{num_devices}. Fix: start with XLA_FLAGS=--xla_force_host_platform_"
                     f"device_count={need} JAX_PLATFORMS=cpu (fake devices: nothing is allocated) "
                     "or a larger plan.topology.")
  rows = sizes["data"] * sizes["fsdp"]
  if p.batch_size % rows:
    raise ValueError(f"plan.batch_size={p.batch_size} does not divide over data*fsdp = {rows} of "
                     f"plan.plans entry {spec!r}. Fix: a batch size that is a multiple of {rows}.")
  for heads, what in ((v_cfg.n_heads, "query"), (v_cfg.n_kv_heads, "key/value")):
    if heads % sizes["tensor"]:
      raise ValueError(f"plan.plans entry {spec!r}: tensor={sizes['tensor']} does not divide the "
                       f"verifier's {heads} {what} heads. Fix: tensor = a divisor of {heads}.")
  for name in ("batch_size", "context", "prompt_tokens", "gamma"):
    checks.integer(p[name], f"plan.{name}")
  if p.context <= p.prompt_tokens + p.gamma:
    raise ValueError(f"plan.context={p.context} leaves no room for new tokens after "
                     f"plan.prompt_tokens={p.prompt_tokens} and γ={p.gamma} draft slots.")


def abstract_params(cfg, mesh):
  """ShapeDtypeStructs of cfg's parameters with their decoding shardings (no allocation)."""
  shapes = decoder.param_shapes(cfg)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, parallel.decode_param_shardings(mesh, shapes))


shard_bytes = timing.shard_bytes  # bytes one device holds of a tree of sharded structs


def cache_bytes(cfg, batch: int, size: int, sizes: dict) -> int:
  """Bytes of one model's KV cache per device: k and v [L, B, S, K, H], rows over data·fsdp,
  heads over tensor (`parallel.cache_sharding`), plus its slot positions for windowed models."""
  rows = batch // (sizes["data"] * sizes["fsdp"])
  heads = cfg.n_kv_heads // sizes["tensor"]
  kv = 2 * cfg.n_layers * rows * size * heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  return kv + (4 * rows * size if cfg.has_windows else 0)


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """{computation name: its instruction lines} of an HLO module's text, and the entry's name."""
  comps, entry, name = {}, None, None
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      match = re.match(r"(ENTRY )?%?([^\s(]+)", line)
      comps[(name := match.group(2))] = []
      entry = name if match.group(1) else entry
    elif line.startswith("}"):
      name = None
    elif name:
      comps[name].append(line)
  return comps, entry


_CALLS = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)"
                    r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def _trips(line: str, comps: dict) -> int | None:
  """A `while`'s trip count: XLA's known_trip_count, else its condition's `i < N` (a scan or a
  fori_loop counts from 0; XLA:TPU annotates none), else None (the decode loop's `not all done`)."""
  known = _TRIPS.search(line)
  cond = comps.get(re.search(r"condition=%([\w.\-]+)", line).group(1), [])
  consts = dict(re.findall(r"%([\w.\-]+) = [su]\d+\[\]\S* constant\((\d+)\)", "\n".join(cond)))
  less = [re.search(r"compare\(%\S+, %([\w.\-]+)\), direction=LT", x) for x in cond if "ROOT" in x]
  bound = less[0].group(1) if less and less[0] else None
  return int(known.group(1)) if known else int(consts[bound]) if bound in consts else None


def _callees(line: str, comps: dict) -> list[tuple[str, int | None]]:
  """(computation, times it runs per execution of `line`; None: an unknown trip count). An async
  pair's wrapped computation (e.g. a reduce-scatter) runs once, for its start: the done (and any
  update) may name it too."""
  if re.search(r"\sasync-(?:done|update)\(", line):
    return []
  times = _trips(line, comps) if " while(" in line else 1
  branches = [c.strip().lstrip("%") for group in _BRANCHES.findall(line)
              for c in group.split(",") if c.strip()]
  return [(c, times) for c in _CALLS.findall(line)] + [(c, 1) for c in branches]


def _array_bytes(types: str) -> int:
  """Bytes of every array in an HLO type (element bytes from the bit width: bf16 2, f32 4,
  pred 1), a tuple's summed."""
  return sum(int(re.sub(r"\D", "", dt) or 8) // 8 * math.prod(int(d) for d in dims.split(",") if d)
             for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", types))


def _tuple_elements(types: str) -> list[str]:
  """The top-level elements of a tuple type "(a, (b, c), d)" (layouts {..} left in place)."""
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(types):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    elif ch == "," and depth == 1:
      parts.append(types[start:i])
      start = i + 1
  return [*parts, types[start:types.rindex(")")]]


def _type_bytes(types: str, kind: str, start: bool) -> int:
  """The bytes a collective delivers: its result. A combiner may merge several collectives into
  one over a tuple of arrays: all of them count. An async start's type is its result for an
  all-reduce, else (operands, results, context...): the second element."""
  if start and kind != "all-reduce" and types.startswith("("):
    return _array_bytes(_tuple_elements(types)[1])
  return _array_bytes(types)


def collectives_per_round(hlo: str) -> dict[str, dict[str, int]]:
  """{kind: {"count", "bytes", "largest"}} of the collectives one round of the decode loop runs
  (largest: the bytes of the largest one): the body of the entry's `while` without a known trip
  count (the rounds), nested loops multiplied by their trip counts (a nested loop of unknown
  trip count counts once: "unknown_trip_counts")."""
  comps, entry = _computations(hlo)
  loops = [line for line in comps[entry] if " while(" in line and _trips(line, comps) is None]
  if len(loops) != 1:
    raise RuntimeError(f"Expected one decode loop in the compiled program, found {len(loops)}.")
  out = {kind: {"count": 0, "bytes": 0, "largest": 0} for kind in COLLECTIVES}
  out["unknown_trip_counts"] = 0

  def visit(name: str, times: int):
    for line in comps[name]:
      op = _OP.search(line)
      if op:
        kind = out[op.group(2)]
        size = _type_bytes(op.group(1), op.group(2), bool(op.group(3)))
        kind["count"] += times
        kind["bytes"] += times * size
        kind["largest"] = max(kind["largest"], size)
      for callee, n in _callees(line, comps):
        if callee in comps:
          out["unknown_trip_counts"] += n is None
          visit(callee, times * (1 if n is None else n))

  for body_or_condition, _ in _callees(loops[0], comps):
    visit(body_or_condition, 1)
  return out


def prepare(spec: str, p) -> dict:
  """Everything one plan compiles from, after every check (nothing compiled or allocated)."""
  name, sizes = parse_plan(spec)
  devices, target = target_devices(p, math.prod(sizes.values()))
  v_cfg = presets.config(name, dtype=p.dtype, field="plan.plans")
  check_plan(spec, sizes, v_cfg, p, len(devices))
  d_cfg = presets.block_drafter(v_cfg, range(v_cfg.n_layers - p.drafter_blocks, v_cfg.n_layers),
                                "plan.drafter_blocks")
  drafter = features.FeatureDrafter(d_cfg, trees.chain(p.gamma))
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  sampling = Sampling(float(p.temperature))
  loop.check_pair(verifier, drafter)
  loop.DecodeConfig().resolve(drafter.shape, sampling)
  mesh = parallel.make_mesh(sizes, devices[:math.prod(sizes.values())])
  v_params, d_params = abstract_params(v_cfg, mesh), abstract_params(d_cfg, mesh)
  v_cache, d_cache = (cache_bytes(c, p.batch_size, p.context, sizes) for c in (v_cfg, d_cfg))
  v_bytes, d_bytes = shard_bytes(v_params), shard_bytes(d_params)
  if p.must_fit and v_bytes + d_bytes + v_cache + d_cache > CHIPS[p.must_fit].hbm_bytes:
    raise ValueError(_over(spec, p.must_fit, v_bytes + d_bytes + v_cache + d_cache,
                           "weights and caches alone, before compiling"))
  return dict(name=name, sizes=sizes, mesh=mesh, target=target, drafter=drafter, verifier=verifier,
              sampling=sampling, params=(v_params, d_params), caches=v_cache + d_cache,
              weights=v_bytes + d_bytes,  # a round reads the drafter's γ times (its calls)
              read=(timing.decode_read_bytes(v_params, shard_bytes) + v_cache
                    + p.gamma * (timing.decode_read_bytes(d_params, shard_bytes) + d_cache)))


def compile_plan(plan: dict, p) -> dict:
  """Compile one prepared plan (module docstring); its row."""
  mesh, sizes, read = plan["mesh"], plan["sizes"], plan["read"]
  rows, key = parallel.batch_sharding(mesh), jax.eval_shape(lambda: jax.random.key(0))
  args = (*plan["params"],
          jax.ShapeDtypeStruct((p.batch_size, p.prompt_tokens), jnp.int32, sharding=rows),
          jax.ShapeDtypeStruct((p.batch_size,), jnp.int32, sharding=rows),
          jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=parallel.replicated(mesh)))
  new_tokens = p.context - p.prompt_tokens - p.gamma  # S = P + O + M − 1 slots, M = γ + 1
  t0 = time.perf_counter()
  compiled = loop.lower(
      *args, verifier=plan["verifier"], drafter=plan["drafter"], decode=loop.DecodeConfig(),
      sampling=plan["sampling"], max_new_tokens=new_tokens, stop_ids=(), mesh=mesh).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  memory = {k: getattr(mem, f"{k}_size_in_bytes") for k in ("argument", "output", "temp", "alias")}
  total = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
  coll = collectives_per_round(compiled.as_text())
  reduce_bytes = coll["all-reduce"]["bytes"]
  all_bytes = sum(v["bytes"] for k, v in coll.items() if k in COLLECTIVES)
  estimate = {}
  for chip, c in CHIPS.items():
    hbm, ici = 1e3 * read / c.hbm_bytes_per_s, 1e3 * reduce_bytes / c.ici_bytes_per_s
    estimate[chip] = dict(ms=round(hbm + ici, 3), hbm_ms=round(hbm, 3), ici_ms=round(ici, 3),
                          ici_all_ms=round(1e3 * all_bytes / c.ici_bytes_per_s, 3))
  return dict(
      preset=plan["name"], drafter=f"{p.drafter_blocks}-block feature drafter",
      mesh=",".join(f"{a}={s}" for a, s in sizes.items()), devices=math.prod(sizes.values()),
      batch_size=p.batch_size, context=p.context, prompt_tokens=p.prompt_tokens,
      new_tokens=new_tokens, gamma=p.gamma, dtype=p.dtype, temperature=float(p.temperature),
      bytes_per_device=total, gib_per_device=round(total / GIB, 3), memory=memory,
      weights_per_device=plan["weights"], caches_per_device=plan["caches"],
      **{f"fits_{chip}": total <= c.hbm_bytes for chip, c in CHIPS.items()},
      collectives=coll, hbm_bytes_per_round=read, estimate=estimate,
      compile_s=round(compile_s, 1), device=mesh.devices.flat[0].device_kind,
      compiled_on=plan["target"])


def _over(spec: str, chip: str, nbytes: int, what: str) -> str:
  hbm = CHIPS[chip].hbm_bytes
  return (f"plan.must_fit={chip!r}: plan {spec!r} needs {nbytes / GIB:.2f} GiB per device "
          f"({what}), {(nbytes - hbm) / GIB:.2f} GiB over {chip}'s {hbm / GIB:.2f} GiB. Fix: more "
          "devices in the mesh, or a smaller plan.batch_size / plan.context.")


def target_devices(p, n: int) -> tuple[list, str]:
  """(devices, what they are) for n devices: JAX's (real or fake), or a TPU slice of exactly n
  chips ('v5e' -> 'v5e:2x4' for 8: a TPU program spans its slice) libtpu compiles for anywhere."""
  if not p.get("topology"):
    return jax.devices(), f"{jax.devices()[0].platform} ({jax.device_count()} devices)"
  from jax.experimental import topologies  # noqa: PLC0415
  rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
  name = f"{p.topology}:{rows}x{n // rows}"
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices), (
        f"TPU slice {name} (XLA:TPU ahead of time)")
  except Exception as e:  # noqa: BLE001 (no libtpu, or a name it does not know)
    raise ValueError(f"plan.topology={p.topology!r} ({name}): {str(e).splitlines()[0][:90]}. Fix: "
                     "pip install 'libtpu==0.0.42.*' and a 2D TPU such as 'v5e', or ''.") from None


def run(config, workdir: str) -> list[dict]:
  p = config.plan
  if p.must_fit and p.must_fit not in CHIPS:
    raise ValueError(f"plan.must_fit={p.must_fit!r} is not a chip; choose one of "
                     f"{', '.join(CHIPS)} or '' (report only).")
  if not tuple(p.plans):
    raise ValueError("plan.plans is empty: give at least one PRESET:DATAxFSDPxTENSOR (e.g. "
                     "'llama3.1-8b:1x1x8').")
  plans = [prepare(spec, p) for spec in p.plans]  # all checked before the first compile
  rows = [compile_plan(plan, p) for plan in plans]
  if parallel.is_writer():
    os.makedirs(workdir, exist_ok=True)
    for name, text in (("plan.json", json.dumps(rows, indent=2)), ("plan.md", markdown(rows))):
      with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
        f.write(text)
  for spec, row in zip(p.plans, rows):
    if p.must_fit and not row[f"fits_{p.must_fit}"]:
      raise ValueError(_over(spec, p.must_fit, row["bytes_per_device"], "compiled; rows written"))
  return rows


def markdown(rows: list[dict]) -> str:
  """The plans as a table, then each plan's collectives per round."""
  lines = ["| preset | mesh | batch | context | GiB/device | weights GiB | caches GiB | v5e 16 GiB "
           "| H100 80 GB | round estimate v5e ms | H100 ms | v5e ms, every collective |",
           "|---|---|" + "---:|" * 5 + "---|---|---:|---:|---:|"]
  yes = {True: "fits", False: "no"}
  lines += [f"| {r['preset']} | {r['mesh']} | {r['batch_size']} | {r['context']} | "
            f"{r['gib_per_device']:.2f} | {r['weights_per_device'] / GIB:.2f} | "
            f"{r['caches_per_device'] / GIB:.2f} | {yes[r['fits_v5e']]} | {yes[r['fits_h100']]} | "
            f"{r['estimate']['v5e']['ms']:.2f} | {r['estimate']['h100']['ms']:.2f} | "
            f"{r['estimate']['v5e']['hbm_ms'] + r['estimate']['v5e']['ici_all_ms']:.2f} |"
            for r in rows]
  lines += ["", "Collectives per round (count, MiB per device as compiled):", ""]
  for r in rows:
    cells = [f"{k} {v['count']} ({v['bytes'] / 2**20:.1f})"
             for k, v in r["collectives"].items() if k in COLLECTIVES and v["count"]]
    lines.append(f"- {r['preset']} on {r['mesh']}: {', '.join(cells) or 'none'}")
  return "\n".join(lines) + "\n"
