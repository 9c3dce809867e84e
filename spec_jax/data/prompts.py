"""The prompt texts a program's config asks for, and generated word problems.

Shared by every program that decodes prompts (generate, evaluate, benchmark_hf): the same
sources with the same rules, so a config moved from one program to another reads the same
prompts. `math_problem` writes the task suite's grade-school word problems
(`spec_jax.data.suite`).
"""

from __future__ import annotations

import json
import os
import random

from absl import logging

from spec_jax import checks
from spec_jax.data import pipeline


def _read_file(path: str) -> list[str]:
  """Prompts of a file: JSON lines ({"prompt": ...}) or one prompt per line (`\\n` escapes
  allowed); blank lines skipped. Refuses a missing or empty file and an empty JSON prompt,
  naming prompts_file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"prompts_file={path!r} does not exist. Fix: pass a text file with "
                            "one prompt per line, or JSON lines with a \"prompt\" field.")
  out = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      if line.lstrip().startswith("{"):
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"prompts_file={path!r} line {number} starts with '{{' but is not "
                           f"valid JSON ({e.msg}). Fix: one JSON object per line with a "
                           "\"prompt\" field, or plain text lines.") from None
        if not isinstance(record.get("prompt"), str):
          raise ValueError(f"prompts_file={path!r} line {number}: a JSON line needs a string "
                           "\"prompt\" field.")
        if not record["prompt"]:
          raise ValueError(f"prompts_file={path!r} line {number}: the \"prompt\" is empty. Fix: "
                           "give it text, or drop the line (blank lines are skipped).")
        out.append(record["prompt"])
      else:
        out.append(line.rstrip("\n").replace("\\n", "\n"))
  if not out:
    raise ValueError(f"prompts_file={path!r} holds no prompts (empty, or blank lines only). "
                     "Fix: one prompt per line, or JSON lines with a \"prompt\" field.")
  return out


def read_prompts(config, tokenizer, num_data_prompts: int | None = None) -> list[str]:
  """The prompt texts a config asks for.

  `config.prompts_file` (one prompt per line or JSON lines) replaces the other sources, unless
  `config.prompts_mix` is True; otherwise `config.prompts` (a tuple of strings), then
  `num_data_prompts` (default `config.num_data_prompts`) prefixes of ~`data_prompt_tokens`
  tokens from `config.data.prompt_split` (see `pipeline.load_prompts`).
  """
  checks.integer(config.get("num_data_prompts", 0), "num_data_prompts", 0,
                 " (0: no prompts from data.prompt_split)")
  checks.integer(config.get("data_prompt_tokens", 1), "data_prompt_tokens")
  path = config.get("prompts_file", "")
  mix = bool(config.get("prompts_mix", False))
  if path and not mix:
    return _read_file(path)
  prompts = list(config.get("prompts", ()))
  if path:
    prompts += _read_file(path)
  n = config.get("num_data_prompts", 0) if num_data_prompts is None else num_data_prompts
  if n:
    d = config.data
    prompts += pipeline.load_prompts(d.name, d.prompt_split, tokenizer, num=n,
                                     prompt_tokens=config.get("data_prompt_tokens", 64),
                                     seed=config.seed, data_dir=d.data_dir or None,
                                     text_key=d.text_key)
  if not prompts:
    raise ValueError("No prompts: set config.prompts, config.prompts_file or "
                     "config.num_data_prompts.")
  return prompts


def prompt_source(config) -> str:
  """Where a config's prompts come from, for result rows: the file's name, the dataset, or
  'inline'."""
  path = config.get("prompts_file", "")
  if path and not config.get("prompts_mix", False):
    return f"file:{os.path.basename(path)}"
  parts = []
  if config.get("prompts", ()):
    parts.append("inline")
  if path:
    parts.append(f"file:{os.path.basename(path)}")
  if config.get("num_data_prompts", 0):
    parts.append(config.data.name)
  return "+".join(parts) or "none"


def take(texts: list[str], num: int, field: str) -> list[str]:
  """The first `num` prompts, with a warning when fewer exist than `field` asked for."""
  if num < 1:
    raise ValueError(f"{field}={num} must be >= 1.")
  if len(texts) < num:
    logging.warning("%s=%d but only %d prompts are available: running %d.", field, num,
                    len(texts), len(texts))
  return texts[:num]


# ---------------------------------------------------------------------------------------------
# Grade-school word problems (GSM8K-style), generated: the task suite's `math` set. Each template
# draws its numbers from `r` and returns the question with its integer answer (for checking
# outputs; not part of the prompt).

_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal",
          "Kira", "Liam", "Maya", "Noah", "Olivia", "Priya", "Quinn", "Rosa", "Sam", "Tariq")


def _change(r, n):
  a, p, item = r.randint(3, 12), r.randint(2, 9), r.choice(("notebooks", "pens", "mugs",
                                                            "tickets", "sandwiches"))
  bill = 10 * (a * p // 10 + 1 + r.randint(0, 2))
  return (f"{n} buys {a} {item} for ${p} each and pays with ${bill}. How much change does {n} "
          "get back?", bill - a * p)


def _trip(r, n):
  del n
  s1, s2 = r.randrange(30, 75, 5), r.randrange(30, 75, 5)
  h1, h2, v = r.randint(2, 5), r.randint(1, 4), r.choice(("train", "bus", "truck", "car"))
  return (f"A {v} travels at {s1} miles per hour for {h1} hours, then at {s2} miles per hour "
          f"for {h2} hours. How many miles does it travel in total?", s1 * h1 + s2 * h2)


def _give(r, n):
  k, m, b = r.randint(2, 5), r.randint(2, 6), r.randint(5, 20)
  n0, item = r.randint(k * m + 5, 90), r.choice(("stickers", "marbles", "cookies", "cards"))
  return (f"{n} has {n0} {item}. {n} gives {k} {item} to each of {m} friends and then gets {b} "
          f"more. How many {item} does {n} have now?", n0 - k * m + b)


def _wages(r, n):
  w, h, d = r.randint(9, 25), r.randint(3, 8), r.randint(3, 6)
  s, thing = r.randint(20, w * h * d // 2), r.choice(("groceries", "a jacket", "books", "rent"))
  return (f"{n} earns ${w} an hour and works {h} hours a day for {d} days. Then {n} spends ${s} "
          f"on {thing}. How much money does {n} have left?", w * h * d - s)


def _club(r, n):
  del n
  den = r.choice((3, 4, 5))
  num, members = r.randint(1, den - 1), 2 * den * r.randint(3, 8)  # the rest is even
  rest = members - members * num // den
  return (f"A school club has {members} members. {num}/{den} of them walk to school, and half of "
          "the rest ride bikes. How many members ride bikes?", rest // 2)


def _sale(r, n):
  p, pct, k = 20 * r.randint(1, 10), r.choice((10, 20, 25, 50)), r.randint(2, 5)
  thing = r.choice(("lamp", "backpack", "board game", "pair of shoes"))
  return (f"A {thing} costs ${p}. It is on sale for {pct}% off. {n} buys {k} of them. How much "
          f"does {n} pay?", k * p * (100 - pct) // 100)


def _ages(r, n):
  others = [x for x in _NAMES if x != n]
  n2, n3 = r.sample(others, 2)
  a, k = r.randint(4, 12), r.randint(2, 4)
  d = r.randint(1, min(10, a * k - 1))
  return (f"{n} is {a} years old. {n2} is {k} times as old as {n}, and {n3} is {d} years younger "
          f"than {n2}. What is the sum of their ages?", a + a * k + a * k - d)


def _recipe(r, n):
  del n
  c, b, mult = r.randint(2, 4), r.choice((12, 16, 20, 24)), r.randint(2, 5)
  return (f"A recipe uses {c} cups of flour to make {b} cookies. How many cups of flour are "
          f"needed to make {b * mult} cookies?", c * mult)


def _savings(r, n):
  goal, per = 10 * r.randint(15, 40), r.choice((10, 15, 20, 25))
  have = 10 * r.randint(1, goal // 20)
  return (f"{n} wants to buy a bike that costs ${goal}. {n} has already saved ${have} and saves "
          f"${per} each week. How many weeks will it take {n} to have enough money?",
          -(-(goal - have) // per))


def _garden(r, n):
  rows, per = r.randint(4, 12), r.randint(5, 15)
  eaten, plant = r.randint(1, rows * per // 4), r.choice(("carrots", "tulips", "lettuces"))
  return (f"{n} plants {rows} rows of {per} {plant} each. Rabbits eat {eaten} of them. How many "
          f"{plant} are left?", rows * per - eaten)


MATH_TEMPLATES = (_change, _trip, _give, _wages, _club, _sale, _ages, _recipe, _savings, _garden)


def math_problem(index: int, *, seed: int = 0, split: str = "test") -> tuple[str, int]:
  """(question, answer) of problem `index`: a template and its numbers drawn from a
  random.Random seeded by the string (split, seed, index), the same in every Python 3."""
  r = random.Random(f"math:{split}:{seed}:{index}")
  template = r.choice(MATH_TEMPLATES)
  return template(r, r.choice(_NAMES))
