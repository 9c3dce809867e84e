"""The prompt texts a program's config asks for.

Shared by every program that decodes prompts (generate, evaluate, benchmark_hf): the same
sources with the same rules, so a config moved from one program to another reads the same
prompts.
"""

from __future__ import annotations

import json
import os

from absl import logging

from spec_jax.data import pipeline


def _read_file(path: str) -> list[str]:
  """Prompts of a file: JSON lines ({"prompt": ...}) or one prompt per line (`\\n` escapes
  allowed); blank lines skipped. Refuses a missing or empty file, naming prompts_file."""
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
