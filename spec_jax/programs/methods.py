"""Program `methods`: the method registry (`spec_jax.decoding.methods`) as a table, printed and
written to `workdir/methods.md`, so a user sees every name `eval.methods` takes, its SHAPE
grammar, what it needs and its options' defaults (the only defaults there are)."""

from __future__ import annotations

import dataclasses
import os

from spec_jax.decoding import methods


def table() -> str:
  """The registry as a markdown table."""
  lines = ["| method | entry | drafter checkpoint | greedy only | options (defaults) | what it is |",
           "|---|---|---|---|---|---|"]
  for name in methods.names():
    m = methods.get(name)
    shape = f"{name}:{m.grammar}@L" if m.grammar else f"{name}@γ"
    kinds = "none needed" if not m.needs_model else ", ".join(m.kinds)
    opts = "–"
    if m.options is not None:
      opts = ", ".join(f"{m.options_field}.{f.name}={getattr(m.options(), f.name)!r}"
                       for f in dataclasses.fields(m.options))
    lines.append(f"| {name} | `{shape}` | {kinds} | {'yes' if m.greedy_only else 'no'} | "
                 f"{opts} | {m.summary} |")
  return "\n".join(lines) + "\n"


def run(config, workdir: str) -> str:
  del config
  text = table()
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "methods.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return text
