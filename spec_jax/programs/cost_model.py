"""Program `cost_model`: what one verifier call on T tokens costs, measured.

Speculative decoding pays for a verifier call on M = γ + 1 tokens (or a tree's M nodes) what
autoregressive decoding pays for one token only if r(M) = cost(M) / cost(1) = 1, which a memory-
bound accelerator comes close to and a CPU does not. The theory column of every results file
(τ / (r(M) + d·c), DESIGN.md §3) uses r(M) measured in the same run; this program measures the
whole curve once, at each batch size, with the drafter's c and the memory roofline beside it.

Rows (results.json): model ("verifier" / "drafter"), T, batch_size, ms (median of `repeats`
calls, the sizes taking turns; cache of the decoding loop's size, T tokens halfway into it), r
(verifier: ms / ms at T = 1), c (drafter: its one-token ms / the verifier's), roofline_ms (the
model's parameter bytes over the measured memory bandwidth: the floor of any call that reads the
weights once), vs_roofline = ms / roofline_ms, memory_bandwidth_gb_s, device. Also results.md.
"""

from __future__ import annotations

import os

from spec_jax import loading
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.evaluation import report, timing
from spec_jax.models import llama


def run(config, workdir: str) -> list[dict]:
  c = config.cost
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                       field="verifier.checkpoint")
  d_cfg, d_params = loading.load_model(config.drafter, tokenizer, seed=config.seed + 1,
                                       field="drafter.checkpoint")
  bandwidth = timing.memory_bandwidth(c.bandwidth_mb * 2**20, c.repeats)
  device = timing.device_description()
  size = c.position + max(c.tokens) + 1
  rows = []
  for batch_size in c.batch_sizes:
    costs = {}
    for name, cfg, params, tokens in (("verifier", v_cfg, v_params, c.tokens),
                                      ("drafter", d_cfg, d_params, (1,))):
      costs[name] = timing.forward_costs(
          llama.make_apply(cfg), params, lambda cfg=cfg: llama.init_cache(cfg, batch_size, size),
          batch_size=batch_size, tokens=tokens, position=c.position, repeats=c.repeats)
      roofline_ms = 1e3 * timing.param_bytes(params) / bandwidth
      for t in tokens:
        ms = 1e3 * costs[name][t]
        rows.append(dict(
            model=name, T=t, batch_size=batch_size, ms=round(ms, 3),
            r=round(costs[name][t] / costs[name][1], 3) if name == "verifier" else None,
            c=(round(costs[name][1] / costs["verifier"][1], 4) if name == "drafter" else None),
            roofline_ms=round(roofline_ms, 3), vs_roofline=round(ms / roofline_ms, 3),
            memory_bandwidth_gb_s=round(bandwidth / 1e9, 2), device=device,
            checkpoint=(config.verifier if name == "verifier" else config.drafter).checkpoint))
  report.write_results(workdir, rows)
  _write_markdown(workdir, rows, report.launch_command(config, workdir), bandwidth, device)
  return rows


def _write_markdown(workdir, rows, command, bandwidth, device) -> None:
  from spec_jax import parallel  # noqa: PLC0415
  if not parallel.is_writer():
    return
  batches = sorted({r["batch_size"] for r in rows})
  verifier = [r for r in rows if r["model"] == "verifier"]
  tokens = sorted({r["T"] for r in verifier})
  lines = ["# Verifier cost ratio r(T) and drafter cost c", "",
           f"`{command}`", "",
           f"Device: {device}; memory bandwidth {bandwidth / 1e9:.1f} GB/s (the faster of a "
           "jitted sum and a GEMV over a large float32 array). r(T) = ms of a call on T tokens "
           "/ ms of a call on 1 token; roofline = parameter bytes / bandwidth.", "",
           "| T | " + " | ".join(f"B={b} ms | B={b} r" for b in batches) + " |",
           "|---:|" + "---:|---:|" * len(batches)]
  for t in tokens:
    cells = []
    for b in batches:
      row = next(r for r in verifier if r["T"] == t and r["batch_size"] == b)
      cells += [f"{row['ms']:.2f}", f"{row['r']:.2f}"]
    lines.append(f"| {t} | " + " | ".join(cells) + " |")
  lines += ["", "| batch | verifier 1-token ms | roofline ms | × roofline | drafter ms | c |",
            "|---:|---:|---:|---:|---:|---:|"]
  for b in batches:
    v = next(r for r in verifier if r["T"] == 1 and r["batch_size"] == b)
    d = next(r for r in rows if r["model"] == "drafter" and r["batch_size"] == b)
    lines.append(f"| {b} | {v['ms']:.2f} | {v['roofline_ms']:.2f} | {v['vs_roofline']:.2f} | "
                 f"{d['ms']:.2f} | {d['c']:.3f} |")
  with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
