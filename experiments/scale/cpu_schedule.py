"""The order in which XLA:CPU runs a scanned decode layer's weight copies and products, read from
the optimized HLO of a benchmark run (experiments/scale/results.md, "scheduling order").

In the scanned layout each layer's weights are slices of stacked [L, ...] arrays; XLA:CPU copies
every slice out (a `dynamic-slice` fusion, C below) before the product that reads it (D). The
scheduled HLO lists a computation's instructions in the order they run, so the layer loop's body
shows whether each copy is read right after it is written (while it may still be in the cache)
or only after the other copies.

  for order in true false; do
    XLA_FLAGS="--xla_cpu_enable_concurrency_optimized_scheduler=$order \\
        --xla_dump_to=/tmp/hlo_$order --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*generate.*" \\
    python launch.py --config configs/scale.py:preset=llama3.2-1b,repeats=1,new_tokens=4 \\
        --workdir /tmp/dump_$order
  done
  python experiments/scale/cpu_schedule.py /tmp/hlo_true /tmp/hlo_false
"""

import pathlib
import re
import sys

# `%name = shape op(` at the start of an instruction line.
INSTRUCTION = re.compile(r"\s+(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? (\w[\w-]*)\(")


def steps(body: str) -> list[str]:
  """The body's slice copies ("C shape") and matrix products ("D shape"), in schedule order."""
  out = []
  for line in body.splitlines()[1:]:
    match = INSTRUCTION.match(line)
    if not match:
      continue
    name, shape, op = match.groups()
    if op == "fusion" and name.startswith("dynamic-slice"):
      out.append(f"C {shape}")
    elif op == "dot" or (op == "fusion" and name.startswith("ynn_fusion")):
      out.append(f"D {shape}")
  return out


def layer_bodies(hlo: str):
  """(header, rows, steps) of each computation that copies slices out and multiplies them: the
  layer loops of the prefill (a row per prompt token) and of a decode step (one row)."""
  for computation in re.split(r"\n(?=\S)", hlo):
    seq = steps(computation)
    products = [s for s in seq if s.startswith("D ") and s.count(",") == 1]  # [rows, N]
    if any(s.startswith("C") for s in seq) and products:
      rows = max(int(s[s.index("[") + 1:].split(",")[0]) for s in products)
      yield computation.splitlines()[0].split(" (")[0], rows, seq


def main(dump_dirs):
  for folder in dump_dirs:
    # The benchmark's largest generate program holds the prefill's and the decode's loops.
    path = max(pathlib.Path(folder).glob("*generate*after_optimizations.txt"),
               key=lambda p: p.stat().st_size)
    print(f"{folder} ({path.name}):")
    for header, rows, seq in layer_bodies(path.read_text()):
      print(f"  {'decode' if rows == 1 else 'prefill'} layer, {header}: " + ", ".join(seq))


if __name__ == "__main__":
  main(sys.argv[1:])
