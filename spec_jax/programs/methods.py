"""Program `methods`: the method registry (`spec_jax.decoding.methods`) as a table, printed and
written to `workdir/methods.md`, so a user sees every name `eval.methods` takes, its SHAPE
grammar, what it needs and its options' defaults (the only defaults there are).

The README's shorter methods table is rendered from the same registry (`readme_table`) and
kept between the README_BEGIN / README_END markers; `python -m spec_jax.programs.methods
--readme` rewrites it in place, and tests/test_readme.py fails while the two differ."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys

from spec_jax.decoding import methods

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
README_BEGIN = "<!-- methods-table -->"
README_END = "<!-- /methods-table -->"
REGENERATE = "python -m spec_jax.programs.methods --readme"
# What each drafter-checkpoint kind (methods.KINDS) is, in the README's words.
_KIND_WORDS = {"lm": "LM or feature drafter", "steered": "steered drafter", "bpd": "BPD heads"}


def _entry(name: str, m: methods.Method) -> str:
  """The method's entry syntax: `NAME:GRAMMAR@L` for shaped methods, `NAME@γ` for chains."""
  return f"{name}:{m.grammar}@L" if m.grammar else f"{name}@γ"


def table() -> str:
  """The registry as a markdown table."""
  lines = ["| method | entry | drafter checkpoint | greedy only | options (defaults) | what it is |",
           "|---|---|---|---|---|---|"]
  for name in methods.names():
    m = methods.get(name)
    kinds = "none needed" if not m.needs_model else ", ".join(m.kinds)
    opts = "–"
    if m.options is not None:
      opts = ", ".join(f"{m.options_field}.{f.name}={getattr(m.options(), f.name)!r}"
                       for f in dataclasses.fields(m.options))
    lines.append(f"| {name} | `{_entry(name, m)}` | {kinds} | {'yes' if m.greedy_only else 'no'} | "
                 f"{opts} | {m.summary} |")
  return "\n".join(lines) + "\n"


def readme_table() -> str:
  """The README's methods table: name, entry syntax, exact or greedy only, the drafter
  checkpoint it needs, its option group, and its summary; one row per registered method in
  `methods.names()` order. Markdown, ending in a newline."""
  lines = ["| method | syntax | law | needs | options | what it is |",
           "|---|---|---|---|---|---|"]
  for name in methods.names():
    m = methods.get(name)
    law = "greedy only" if m.greedy_only else "exact"
    needs = ("no drafter model" if not m.needs_model
             else " / ".join(_KIND_WORDS.get(k, k) for k in m.kinds))
    opts = f"`eval.{m.options_field}.*`" if m.options is not None else "–"
    summary = m.summary.replace("|", "\\|")  # a pipe would split the cell
    lines.append(f"| `{name}` | `{_entry(name, m)}` | {law} | {needs} | {opts} | {summary} |")
  return "\n".join(lines) + "\n"


def readme_section(text: str) -> str:
  """What `text` (the README) holds between the markers; ValueError naming the fix if they are
  missing or out of order."""
  start, end = text.find(README_BEGIN), text.find(README_END)
  if start < 0 or end < start:
    raise ValueError(f"README.md needs the lines {README_BEGIN} and {README_END} around the "
                     f"methods table. Fix: add them, then run `{REGENERATE}`.")
  return text[start + len(README_BEGIN):end].strip("\n") + "\n"


def update_readme(path: str | os.PathLike = README) -> bool:
  """Rewrite the methods table between the markers of `path` from the registry. Returns whether
  the file changed."""
  path = pathlib.Path(path)
  text = path.read_text(encoding="utf-8")
  readme_section(text)  # the markers are there
  head, rest = text.split(README_BEGIN, 1)
  _, tail = rest.split(README_END, 1)
  new = f"{head}{README_BEGIN}\n{readme_table()}{README_END}{tail}"
  if new != text:
    path.write_text(new, encoding="utf-8")
  return new != text


def run(config, workdir: str) -> str:
  del config
  text = table()
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "methods.md"), "w", encoding="utf-8") as f:
    f.write(text)
  print(text)
  return text


def main(argv: list[str]) -> int:
  """`--readme`: rewrite README.md's methods table; otherwise print the registry table."""
  if argv == ["--readme"]:
    changed = update_readme()
    print(f"{README}: methods table {'rewritten' if changed else 'already up to date'}.")
    return 0
  if argv:
    print(f"usage: python -m spec_jax.programs.methods [--readme]; got {argv}.", file=sys.stderr)
    return 2
  print(table())
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
