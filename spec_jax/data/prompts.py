"""The prompt texts a program's config asks for.

Shared by every program that decodes prompts (generate, evaluate, benchmark_hf): the same three
sources, in the same order, so a config moved from one program to another reads the same prompts.
"""

from __future__ import annotations

import os

from spec_jax.data import pipeline


def read_prompts(config, tokenizer) -> list[str]:
  """The prompt texts a config asks for, in order: inline, then file, then data split.

  `config.prompts` (a tuple of strings), `config.prompts_file` (one prompt per line, `\\n` escapes
  allowed, blank lines skipped), then `config.num_data_prompts` prefixes of ~`data_prompt_tokens`
  tokens from `config.data.prompt_split` (see `pipeline.load_prompts`).
  """
  prompts = list(config.get("prompts", ()))
  path = config.get("prompts_file", "")
  if path:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"prompts_file={path!r} does not exist.")
    with open(path, encoding="utf-8") as f:
      prompts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
  n = config.get("num_data_prompts", 0)
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
