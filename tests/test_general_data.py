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


def test_a_response_keeps_the_end_of_turn_the_verifier_stopped_at():
  """SmolLM2 stops a turn with <|im_end|>; the token stream appends <|endoftext|> to every
  document, so a response keeps the first and leaves out the second; one cut at the budget keeps
  no stop token. An instruction is cut at its stop."""
  from spec_jax.data import tokenizer as tokenizer_lib  # noqa: PLC0415
  tok = tokenizer_lib.smollm2_tokenizer()
  im_end, eos = tok.encode("<|im_end|>")[0], tok.eos_id
  assert im_end in tok.stop_ids and eos in tok.stop_ids and im_end != eos
  said = {"instruction": tok.encode("Write about the sea in a few words."),
          "response": tok.encode(" Waves.")}

  def generate_fn(prompts, max_new_tokens, rng):
    del rng
    what = "instruction" if max_new_tokens == 24 else "response"
    rows = [said[what] + [im_end, eos], said[what] + [eos, im_end], said[what]]
    return [rows[i % 3] for i in range(len(prompts.lengths))]

  spec = general_data.Spec(topics=1, corpus_prompts=0, instruction_tokens=24,
                           response_tokens=12, batch_size=3)
  examples = general_data.build_examples(generate_fn, tok, spec)
  docs = [ex for split in examples.values() for _, ex in split]
  assert docs and {d["prompt"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
                   for d in docs} == {"Write about the sea in a few words."}
  # Rows 0, 1, 2 of a batch: stopped at <|im_end|>, stopped at EOS, cut at the budget.
  assert [d["response"] for d in docs] == [
      " Waves.<|im_end|>" if int(k[:5]) % 3 == 0 else " Waves."
      for split in examples.values() for k, _ in split]


def test_checkpoints_of_one_name_get_datasets_of_their_own(tmp_path):
  """A verifier checkpoint is named by what it holds as well as by its basename: two runs'
  `verifier` directories, or one trained again, never read each other's responses."""
  import jax  # noqa: PLC0415
  from spec_jax.training import checkpoints  # noqa: PLC0415
  cfg, params = testing.tiny_model(seed=0)

  def save(path, step, params):
    manager = checkpoints.make_manager(str(path), async_save=False)
    state = type("State", (), dict(step=step, params=params, opt_state={}))()
    checkpoints.save(manager, step, state, checkpoints.make_meta(cfg, ByteTokenizer()))
    manager.close()
    return SPEC.config_name(str(path))

  a = save(tmp_path / "a" / "verifier", 1, params)
  b = save(tmp_path / "b" / "verifier", 1, jax.tree.map(lambda x: x + 1, params))
  assert a.startswith("verifier_s0_") and b.startswith("verifier_s0_") and a != b
  assert save(tmp_path / "a" / "verifier", 2, params) != a  # trained further at its path
  # A packaged model is named by its name alone, as before.
  assert SPEC.config_name("smollm2-135m-seed0") == (
      "smollm2135mseed0_s0_t2_c2_r12_T1p0_shakespeare_4ffe80")
