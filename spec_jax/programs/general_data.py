"""Program `general_data`: build the general-domain distillation dataset
(`spec_jax.training.general_data`) with the verifier, once, into the data dir.

`run(config, workdir)` reads config sections verifier, general, data_dir, seed, preview
(configs/general_data.py). A dataset already prepared for the same verifier and settings is
reused; WORKDIR/general_data.json names it with its documents per split and source, and
WORKDIR/preview.jsonl holds its first examples.
"""

from __future__ import annotations

import collections
import json
import os
import time

from spec_jax import loading
from spec_jax.data import pipeline
from spec_jax.data.tokenizer import get_tokenizer
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.training import general_data


def spec_of(config) -> general_data.Spec:
  return general_data.Spec(seed=int(config.seed), **dict(config.general))


def run(config, workdir: str) -> dict:
  workdir = os.path.abspath(workdir)
  spec = spec_of(config)  # bad settings fail before the verifier loads
  os.makedirs(workdir, exist_ok=True)
  tokenizer = get_tokenizer(config.tokenizer)
  verifier = config.verifier.checkpoint or f"{config.verifier.size}-seed{config.seed}"
  data_dir = config.data_dir or None
  name = general_data.dataset_name(spec, verifier)
  t0 = time.perf_counter()
  built = not general_data.is_prepared(spec, verifier, data_dir)
  if built:
    v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                         field="verifier.checkpoint")
    fn = general_data.sampler(v_params, v_cfg, sampling_lib.Sampling(spec.temperature),
                              tokenizer.stop_ids)
    examples = general_data.build_examples(fn, tokenizer, spec, data_dir=data_dir)
    general_data.prepare(examples, spec, verifier, data_dir, description=(
        f"Verifier {verifier} ({tokenizer.name}) answering self-written instructions and "
        f"corpus-continuation requests; {spec}."))
  splits, sources, preview = {}, collections.Counter(), []
  for split in ("train", "validation", "test"):
    src = pipeline.text_source(name, split, data_dir=data_dir, text_key="source")
    splits[split] = len(src)
    sources.update(src[i] for i in range(len(src)))
  texts = pipeline.text_source(name, "train", data_dir=data_dir)
  preview = [texts[i] for i in range(min(int(config.preview), len(texts)))]
  summary = dict(dataset=name, built=built, seconds=round(time.perf_counter() - t0, 1),
                 splits=splits, sources=dict(sorted(sources.items())), spec=vars(spec))
  with open(os.path.join(workdir, "general_data.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  with open(os.path.join(workdir, "preview.jsonl"), "w", encoding="utf-8") as f:
    for text in preview:
      f.write(json.dumps({"text": text}) + "\n")
  print(f"Dataset {name}: {splits}. Train a drafter on it with --config.data.name={name}")
  return summary
