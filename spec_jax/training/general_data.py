"""General-domain distillation data built on the machine: the verifier answers a broad prompt set
(self-instruct), and the result is cached as a local TFDS dataset.

The prompt set:
  * instructions the verifier writes itself: for every seed topic (`SEED_TOPICS`) and request
    template (`REQUESTS`), one sampled reply to "write a question/task about <topic>", cleaned
    to its first line (Wang et al. 2023, "Self-Instruct", at the scale of a 135M model);
  * prefixes of the Shakespeare and Python-stdlib train splits, wrapped in a request to
    continue them.
Every prompt is rendered with the verifier's chat template, then the verifier samples a response
(T = `temperature`). A document is prompt + response (`text`), with `prompt`, `response` and
`source` (topic:…, shakespeare, pystdlib) beside it; splits by md5 of the document's key
(90/5/5). Everything is drawn from `seed`: the same seed, verifier and sizes give the same
dataset, byte for byte.

`distill --config.data.name=spec_jax_general/<name>` then trains on it (source=fixed: the
verifier's own text; a reduced vocabulary counted on it covers prose and code).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import re
from typing import Callable, Sequence

import jax
import tensorflow_datasets as tfds

from spec_jax.data import corpora, pipeline
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.training import checkpoints

NAME = "spec_jax_general"

SEED_TOPICS = (
    "cooking", "baking bread", "gardening", "astronomy", "volcanoes", "ocean life", "birds",
    "climate", "the human heart", "nutrition", "sleep", "exercise", "first aid", "chemistry",
    "electricity", "magnets", "simple machines", "the solar system", "dinosaurs", "ancient Rome",
    "ancient Egypt", "the Renaissance", "the printing press", "world geography", "mountains",
    "rivers", "deserts", "languages", "grammar", "poetry", "writing a letter", "storytelling",
    "music theory", "painting", "photography", "chess", "football", "the Olympics", "travel",
    "saving money", "budgeting", "starting a business", "job interviews", "friendship",
    "time management", "studying for exams", "mathematics", "fractions", "geometry",
    "probability", "statistics", "computers", "the internet", "Python programming",
    "sorting algorithms", "databases", "web pages", "robots", "electric cars", "recycling",
    "pets", "dogs", "cats", "weather", "rain", "the moon", "trees", "insects", "bees")

REQUESTS = (
    "Write one question that a curious student might ask about {topic}. Reply with the question "
    "only.",
    "Write one short instruction asking an assistant to explain something about {topic}. Reply "
    "with the instruction only.",
    "Write one request for a short piece of writing about {topic}. Reply with the request only.")

CORPUS_REQUESTS = {
    corpora.SHAKESPEARE: "Continue this passage in the same style:\n\n{text}",
    corpora.PYSTDLIB: "Continue this Python code:\n\n{text}",
}


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a general dataset is made of (its TFDS config name is derived from it)."""
  seed: int = 0
  topics: int = len(SEED_TOPICS)       # the first `topics` seed topics, × every request
  corpus_prompts: int = 64             # prefixes per corpus
  corpora: tuple[str, ...] = tuple(CORPUS_REQUESTS)
  prefix_tokens: int = 48
  instruction_tokens: int = 40
  response_tokens: int = 96
  temperature: float = 1.0
  batch_size: int = 16

  def __post_init__(self):
    if not 1 <= self.topics <= len(SEED_TOPICS):
      raise ValueError(f"general.topics={self.topics} must be in 1..{len(SEED_TOPICS)}.")
    for f in ("prefix_tokens", "instruction_tokens", "response_tokens", "batch_size"):
      if getattr(self, f) < 1:
        raise ValueError(f"general.{f} must be >= 1, got {getattr(self, f)}.")
    if not isinstance(self.corpora, tuple):
      object.__setattr__(self, "corpora", tuple(self.corpora))
    unknown = [c for c in self.corpora if c not in CORPUS_REQUESTS]
    if unknown:
      raise ValueError(f"general.corpora: {unknown} are not corpora with a request template; "
                       f"choose from {list(CORPUS_REQUESTS)}.")
    if self.corpus_prompts < 0 or self.temperature <= 0:
      raise ValueError("general.corpus_prompts must be >= 0 and general.temperature > 0 (the "
                       "responses are sampled).")

  def config_name(self, verifier: str) -> str:
    """e.g. 'smollm2_s0_t69_c64_r96_T1p0_c2416b'. A verifier that is a spec_jax checkpoint is
    named by what it holds too (`checkpoints.identity`): two checkpoints of one basename, or one
    trained again at its path, get datasets of their own."""
    tag = re.sub(r"[^a-z0-9]+", "", os.path.basename(verifier.rstrip("/")).lower()) or "model"
    name = (f"{tag}_s{self.seed}_t{self.topics}_c{self.corpus_prompts}_r{self.response_tokens}"
            f"_T{str(self.temperature).replace('.', 'p')}")
    if self.corpora != tuple(CORPUS_REQUESTS):
      name += "_" + "_".join(c.removeprefix("spec_jax_") for c in self.corpora)
    # Everything else that shapes the data, so a changed setting never reads a stale build.
    rest = f"{self.prefix_tokens}/{self.instruction_tokens}/{self.batch_size}"
    if held := checkpoints.identity(verifier):
      rest += f"/{held}"
    return f"{name}_{hashlib.md5(rest.encode()).hexdigest()[:6]}"


def chat(tokenizer, user: str) -> str:
  """One user turn in the tokenizer's chat template (ChatML for tokenizers without one)."""
  if hasattr(tokenizer, "chat_prompt"):
    return tokenizer.chat_prompt(user)
  return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _sample(generate_fn: Callable, tokenizer, prompts: Sequence[str], max_tokens: int,
            key: jax.Array, batch_size: int, label: str, keep_stop: bool = False) -> list[str]:
  """The texts sampled after each prompt, batch by batch (key folded with the batch index, so a
  batch's draws depend on the seed and its position alone), each cut at its first stop token.
  keep_stop: a response keeps the stop token that ended it (the verifier's end of turn, e.g.
  SmolLM2's <|im_end|>), so a drafter trained on the text learns where the verifier stops;
  the tokenizer's EOS is left out, as the token stream appends it to every document."""
  from tqdm import tqdm  # noqa: PLC0415
  out = []
  for i in tqdm(range(0, len(prompts), batch_size), desc=label, leave=False,
                disable=jax.process_index() != 0):
    batch = list(prompts[i:i + batch_size])
    real = len(batch)
    batch += [batch[-1]] * (batch_size - real)  # one compiled shape for every batch
    ids = tokenizer.encode_batch(batch)
    width = max(len(r) for r in ids)
    width = -(-width // 32) * 32  # a few prompt widths, not one per batch
    prompts_arr = generate_lib.pad_prompts(ids, width, tokenizer.pad_id)
    new = generate_fn(prompts_arr, max_tokens, jax.random.fold_in(key, i))
    for row in new[:real]:
      row = list(row)
      stop = next((i for i, t in enumerate(row) if t in tokenizer.stop_ids), len(row))
      kept = row[:stop + (keep_stop and stop < len(row) and row[stop] != tokenizer.eos_id)]
      out.append(tokenizer.decode(kept))
  return out


def _first_line(text: str) -> str:
  for line in text.strip().splitlines():
    line = line.strip().strip('"').strip()
    if line:
      return line
  return ""


def build_examples(generate_fn: Callable, tokenizer, spec: Spec, *, data_dir: str | None = None
                   ) -> dict[str, list[tuple[str, dict]]]:
  """split → [(key, {text, prompt, response, source})]. generate_fn(Prompts, max_new_tokens,
  rng) → the new token lists of every row (the verifier's sampler at spec.temperature)."""
  key = jax.random.key(spec.seed)
  requests = [(topic, r.format(topic=topic)) for topic in SEED_TOPICS[:spec.topics]
              for r in REQUESTS]
  written = _sample(generate_fn, tokenizer, [chat(tokenizer, r) for _, r in requests],
                    spec.instruction_tokens, jax.random.fold_in(key, 1), spec.batch_size,
                    "instructions")
  items, seen = [], set()
  for (topic, _), text in zip(requests, written):
    line = _first_line(text)
    if len(line) >= 12 and line.lower() not in seen:  # drop empty and duplicate instructions
      seen.add(line.lower())
      items.append((f"topic:{topic}", line))
  for j, name in enumerate(spec.corpora):
    template = CORPUS_REQUESTS[name]
    if spec.corpus_prompts:
      prefixes = pipeline.load_prompts(name, "train", tokenizer, num=spec.corpus_prompts,
                                       prompt_tokens=spec.prefix_tokens, seed=spec.seed + j,
                                       data_dir=data_dir)
      items += [(name.removeprefix("spec_jax_"), template.format(text=p)) for p in prefixes]
  prompts = [chat(tokenizer, user) for _, user in items]
  responses = _sample(generate_fn, tokenizer, prompts, spec.response_tokens,
                      jax.random.fold_in(key, 2), spec.batch_size, "responses", keep_stop=True)
  splits: dict[str, list] = {"train": [], "validation": [], "test": []}
  for i, ((source, _), prompt, response) in enumerate(zip(items, prompts, responses)):
    doc_key = f"{i:05d}:{source}"
    bucket = int(hashlib.md5(doc_key.encode()).hexdigest(), 16) % 100
    split = "train" if bucket < 90 else "validation" if bucket < 95 else "test"
    splits[split].append((doc_key, {"text": prompt + response, "prompt": prompt,
                                    "response": response, "source": source}))
  return splits


class SpecJaxGeneral(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """The general dataset: examples built by `build_examples`, written once as array_record.
  Read back like any prepared TFDS dataset (`spec_jax_general/<config name>`)."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.0.0": "Self-instruct + corpus-prefix prompts with verifier responses.",
                   "1.1.0": "A response keeps the end-of-turn token the verifier stopped at."}

  def __init__(self, *, examples=None, description: str = "", **kwargs):
    self._examples_by_split = examples
    self._description = description
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
        builder=self, description=self._description or "General-domain verifier responses.",
        features=tfds.features.FeaturesDict({"text": text, "prompt": tfds.features.Text(),
                                             "response": tfds.features.Text(),
                                             "source": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    if self._examples_by_split is None:
      raise ValueError(f"{NAME}/{self.builder_config.name} is not prepared: build it with "
                       "`python launch.py --config configs/general_data.py --workdir DIR`.")
    return {k: self._generate_examples(v) for k, v in self._examples_by_split.items() if v}

  def _generate_examples(self, examples):
    yield from examples


def dataset_name(spec: Spec, verifier: str) -> str:
  return f"{NAME}/{spec.config_name(verifier)}"


def prepare(examples, spec: Spec, verifier: str, data_dir: str | None = None,
            description: str = "") -> str:
  """Write `examples` as the TFDS dataset `dataset_name(spec, verifier)` in the data dir (once:
  a prepared one is kept); returns its name."""
  root = pipeline.data_dir(data_dir)
  builder = SpecJaxGeneral(config=tfds.core.BuilderConfig(name=spec.config_name(verifier)),
                           data_dir=root, file_format="array_record", examples=examples,
                           description=description)
  if not builder.is_prepared():
    # TFDS prints "Downloading and preparing" even for local examples (its bars: cli.py).
    with contextlib.redirect_stdout(io.StringIO()):
      builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
          try_download_gcs=False, compute_stats=tfds.download.ComputeStatsMode.SKIP))
  return dataset_name(spec, verifier)


def is_prepared(spec: Spec, verifier: str, data_dir: str | None = None) -> bool:
  root = pipeline.data_dir(data_dir)
  return os.path.isdir(os.path.join(root, NAME, spec.config_name(verifier),
                                    str(SpecJaxGeneral.VERSION)))


def sampler(params, cfg, sampling: sampling_lib.Sampling, stop_ids) -> Callable:
  """generate_fn for `build_examples`: the jitted batched sampler of one model."""

  def fn(prompts, max_new_tokens, rng):
    return generate_lib.generate(params, prompts, rng, cfg=cfg, sampling=sampling,
                                 max_new_tokens=max_new_tokens, stop_ids=stop_ids).new_tokens()

  return fn
