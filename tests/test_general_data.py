"""General-domain distillation data (self-instruct + corpus prefixes, verifier responses):
deterministic given its seed, written and read back as a TFDS dataset, bad settings named."""

import dataclasses

import pytest

from spec_jax import testing
from spec_jax.data import pipeline
from spec_jax.data.tokenizer import ByteTokenizer
from spec_jax.decoding.sampling import Sampling
from spec_jax.training import general_data

SPEC = general_data.Spec(seed=0, topics=2, corpus_prompts=2, corpora=("spec_jax_shakespeare",),
                         prefix_tokens=16, instruction_tokens=24, response_tokens=12,
                         batch_size=4)


def _build(spec, data_dir):
  cfg, params = testing.tiny_model(vocab_size=257)
  tok = ByteTokenizer()
  fn = general_data.sampler(params, cfg, Sampling(1.0), tok.stop_ids)
  return general_data.build_examples(fn, tok, spec, data_dir=data_dir)


def test_deterministic_given_its_seed_and_read_back_as_tfds(data_dir):
  first = _build(SPEC, data_dir)
  assert _build(SPEC, data_dir) == first
  assert _build(dataclasses.replace(SPEC, seed=1), data_dir) != first
  docs = [ex for split in first.values() for _, ex in split]
  sources = {d["source"] for d in docs}
  assert "shakespeare" in sources and any(s.startswith("topic:") for s in sources)
  for d in docs:
    assert d["text"] == d["prompt"] + d["response"]
    assert d["prompt"].endswith("<|im_start|>assistant\n")
  name = general_data.prepare(first, SPEC, "tiny", data_dir)
  assert general_data.is_prepared(SPEC, "tiny", data_dir)
  for split, examples in first.items():
    if examples:
      src = pipeline.text_source(name, split, data_dir=data_dir)
      # TFDS orders a split by its keys' hashes.
      assert sorted(src[i] for i in range(len(src))) == sorted(ex["text"] for _, ex in examples)


@pytest.mark.parametrize("field, value, message", [
    ("topics", 0, "general.topics=0"), ("response_tokens", 0, "general.response_tokens"),
    ("corpora", ("wiki",), "general.corpora"), ("temperature", 0.0, "general.temperature")])
def test_bad_settings_are_named(field, value, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(SPEC, **{field: value})
