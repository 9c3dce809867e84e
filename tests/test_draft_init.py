"""Drafters built from a verifier (`models/draft_init.py`): layer subsets, reduced output
vocabularies (lossless and greedy-exact decoding, training, checkpoints) and their bad input.
Tiny models, CPU only."""

import dataclasses

import jax
import numpy as np
import pytest

from configs import common
from configs import train_lm as train_lm_config
from spec_jax import loading, testing
from spec_jax.data import pipeline
from spec_jax.data.tokenizer import ByteTokenizer, get_tokenizer
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import lm, trees
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import draft_init, gemma, layers, llama
from spec_jax.programs import train_lm


def _logits(cfg, params, tokens):
  """float32[B, T, V] (numpy) of the model at tokens int[B, T]."""
  tokens = np.asarray(tokens, np.int32)
  positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
  return np.asarray(testing.jitted_apply(cfg)(params, tokens, positions)[0])


def test_all_layers_reproduce_the_verifier_and_a_subset_keeps_its_blocks():
  cfg, params = testing.tiny_model(seed=3, vocab_size=61)
  tokens = [[1, 5, 9, 2, 7, 7, 30]]
  same_cfg, same = draft_init.select_layers(cfg, params, range(cfg.n_layers))
  np.testing.assert_array_equal(_logits(same_cfg, same, tokens), _logits(cfg, params, tokens))
  # Keeping block 1 alone is the model whose only block is block 1 (embedding, norm, head kept).
  one_cfg, one = draft_init.select_layers(cfg, params, [1])
  assert one_cfg.n_layers == 1 and one_cfg.num_params < cfg.num_params
  by_hand = {**params, "layers": jax.tree.map(lambda x: np.asarray(x)[1:2], params["layers"])}
  np.testing.assert_array_equal(_logits(one_cfg, one, tokens),
                                _logits(dataclasses.replace(cfg, n_layers=1), by_hand, tokens))
  assert not np.array_equal(_logits(one_cfg, one, tokens), _logits(cfg, params, tokens))
  # Sliding windows (and so Gemma 3's local RoPE) follow their layers.
  g_cfg = gemma.GemmaConfig(**{**dataclasses.asdict(cfg), "family": "gemma",
                               "layer_windows": (4, 0)})
  assert draft_init.select_layers(g_cfg, params, [1])[0].layer_windows == (0,)


def test_layers_are_selected_from_an_unrolled_model_too():
  """A model in the unrolled layout (`layers_<i>`, as a checkpoint trained with :unrolled=1
  holds) keeps its blocks in its own layout: blocks 2 and 0 of it are the stacked selection's."""
  cfg, params = testing.tiny_model(seed=3, vocab_size=61, n_layers=3)
  u_cfg = dataclasses.replace(cfg, unrolled=True)
  unrolled = layers.unstack_layers(params, cfg.n_layers)
  got_cfg, got = draft_init.select_layers(u_cfg, unrolled, [2, 0])
  want_cfg, want = draft_init.select_layers(cfg, params, [2, 0])
  assert got_cfg == dataclasses.replace(want_cfg, unrolled=True)
  assert sorted(got) == sorted(layers.unstack_layers(want, 2))
  tokens = [[1, 5, 9, 2, 7, 7, 30]]
  np.testing.assert_array_equal(_logits(got_cfg, got, tokens), _logits(want_cfg, want, tokens))


@pytest.mark.parametrize("size, want", [
    ("smollm2-135m:layers=0,14,29", (0, 14, 29)), ("smollm2-135m:layers=2+0", (2, 0)),
    ("smollm2-135m:first=3", (0, 1, 2)), ("smollm2-135m:every=10", (0, 10, 20))])
def test_size_strings_select_layers(size, want):
  assert draft_init.layer_subset(draft_init.parse_size(size), 30) == want


def test_top_ids_and_target_mapping():
  counts = np.array([5, 0, 9, 9, 1, 7])
  assert draft_init.top_ids(counts, 3) == (2, 3, 5)  # ties: the lower id first
  cfg = llama.model_config("test-tiny", vocab_size=6, tie_embeddings=False, head_ids=(2, 3, 5))
  batch = {"inputs": np.zeros((1, 4), np.int32), "targets": np.array([[5, 0, 2, 3]]),
           "weights": np.ones((1, 4), np.float32)}
  out = draft_init.map_batch(cfg, batch)
  np.testing.assert_array_equal(out["targets"], [[2, 0, 0, 1]])
  np.testing.assert_array_equal(out["weights"], [[1, 0, 1, 1]])


def _reduced_pair(vocab_size=6, keep=(0, 2, 3), drafter_seed=5, sharpness=3.0):
  """A verifier with mass on every token and a drafter that can draft only `keep`."""
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=vocab_size, sharpness=sharpness)
  d_cfg, d_params = testing.tiny_model(seed=drafter_seed, vocab_size=vocab_size,
                                       sharpness=sharpness)
  d_cfg, d_params = draft_init.reduce_vocab(d_cfg, d_params, keep)
  return v_cfg, v_params, d_cfg, d_params


class _LeakyQ(lm.LMDrafter):
  """Planted bug: drafts from the reduced law but reports some mass outside it."""

  def propose(self, *args, **kwargs):
    proposal, state = super().propose(*args, **kwargs)
    return proposal.replace(q=0.8 * proposal.q + 0.2 / proposal.q.shape[-1]), state


def _first_two_tokens(drafter_cls, n_samples=3000):
  v_cfg, v_params, d_cfg, d_params = _reduced_pair()
  prompt = [1, 4, 2]
  law = testing.exact_sequence_law(v_cfg, v_params, prompt, 2, Sampling(1.0))
  prompts = generate_lib.pad_prompts([prompt] * n_samples, 3, pad_id=0)
  out = loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(0), verifier=verifier_lib.lm_verifier(v_cfg),
      drafter=drafter_cls(d_cfg, trees.chain(3)), sampling=Sampling(1.0), max_new_tokens=2)
  samples = [tuple(r) for r in out.new_tokens()]
  return law, samples, out


@pytest.mark.parametrize("tied", [True, False])
def test_restricted_teacher_is_the_full_teacher_at_the_reduced_ids(tied):
  """distill's teacher for a reduced student applies its output layer to the kept rows only:
  the same logits as the full forward gathered at those ids, and the same hidden states."""
  cfg, params = testing.tiny_model(seed=3, vocab_size=61, tie_embeddings=tied)
  student, _ = draft_init.reduce_vocab(cfg, None, [2, 7, 30, 44, 60])
  tokens = np.asarray([[1, 5, 9, 2, 7, 7, 30]], np.int32)
  positions = np.arange(7, dtype=np.int32)[None]
  # Both forwards jitted, as distill runs them (eagerly, each op compiles on its own).
  full, hidden, _ = jax.jit(llama.make_apply(cfg, (1,)))(params, tokens, positions)
  got, got_hidden, _ = jax.jit(draft_init.restrict(student, cfg, (1,)))(params, tokens, positions)
  np.testing.assert_allclose(got, np.asarray(full)[..., [2, 7, 30, 44, 60]], rtol=1e-5,
                             atol=1e-5)
  assert list(got_hidden) == [1]
  np.testing.assert_array_equal(got_hidden[1], hidden[1])


@pytest.mark.parametrize("tied, reduced", [(True, True), (False, True), (True, False)])
def test_teacher_parts_compose_to_the_restricted_teacher(tied, reduced):
  """distill's teacher cache stores body's hidden states and later runs head alone: head(body)
  is restrict's forward (logits at the student's rows, hidden at the asked layers)."""
  cfg, params = testing.tiny_model(seed=3, vocab_size=61, tie_embeddings=tied)
  student = draft_init.reduce_vocab(cfg, None, [2, 7, 30, 44, 60])[0] if reduced else cfg
  tokens = np.asarray([[1, 5, 9, 2, 7, 7, 30], [3, 3, 8, 0, 59, 1, 2]], np.int32)
  positions = np.broadcast_to(np.arange(7, dtype=np.int32), tokens.shape)
  # Every part jitted, as distill's step and teacher cache run them.
  want, want_hidden, _ = jax.jit(draft_init.restrict(student, cfg, (1,)))(params, tokens,
                                                                          positions)
  body, head = draft_init.teacher_parts(student, cfg, (1,))
  hidden = jax.jit(body)(params, tokens, positions)
  assert set(hidden) == {1, draft_init.FINAL}
  got, got_hidden = jax.jit(head)(params, hidden)
  assert got.shape == want.shape == (2, 7, 5 if reduced else 61)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert list(got_hidden) == [1]
  np.testing.assert_array_equal(got_hidden[1], want_hidden[1])
  if reduced:  # a teacher with a reduced vocabulary of its own has no such split
    assert draft_init.teacher_parts(cfg, student, (1,)) is None


def test_reduced_vocabulary_is_lossless():
  law, samples, out = _first_two_tokens(lm.LMDrafter)
  # The verifier puts mass on the tokens the drafter cannot draft, and they are emitted.
  outside = sum(p for seq, p in law.items() if seq[0] in (1, 4, 5))
  assert outside > 0.2
  assert any(s[0] in (1, 4, 5) for s in samples)
  assert testing.chi_square_pvalue(samples, law) > 1e-3
  reached = float(np.sum(out.stats.reached))
  assert 0.05 < float(np.sum(out.stats.alpha_sum)) / reached < 0.95
  # The planted bug fails the same check.
  law, samples, _ = _first_two_tokens(_LeakyQ)
  assert testing.chi_square_pvalue(samples, law) < 1e-4


def test_reduced_vocabulary_drafts_only_its_tokens_and_greedy_is_exact():
  v_cfg, v_params, d_cfg, d_params = _reduced_pair(vocab_size=257, keep=tuple(range(0, 257, 2)),
                                                   sharpness=4.0)
  logits = _logits(d_cfg, d_params, [[3, 8, 9]])
  assert np.all(np.isneginf(logits[..., 1::2])) and np.all(np.isfinite(logits[..., ::2]))
  prompts = generate_lib.pad_prompts([[5, 6, 7, 8, 9], [40], [100, 101, 102]], 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=12)
  sd = testing.lm_speculative(v_cfg, v_params, d_cfg, d_params, prompts, jax.random.key(0),
                              gamma=4, max_new_tokens=12, sampling=Sampling())
  assert sd.new_tokens() == ar.new_tokens()
  # The verifier as its own drafter, reduced to the tokens it emits greedily, accepts them all.
  want = sorted({t for row in ar.new_tokens() for t in row})
  r_cfg, r_params = draft_init.reduce_vocab(v_cfg, v_params, want)
  same = testing.lm_speculative(v_cfg, v_params, r_cfg, r_params, prompts, jax.random.key(0),
                                gamma=4, max_new_tokens=12, sampling=Sampling())
  assert same.new_tokens() == ar.new_tokens()
  np.testing.assert_array_equal(same.stats.accepted_at, same.stats.reached)


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
  """A train_lm:smoke checkpoint with a reduced vocabulary of 40 byte tokens."""
  config = train_lm_config.get_config("smoke")
  config.mesh.data = 1
  config.data.data_dir = data_dir
  config.model.size = "test-tiny:vocab=40"
  config.train.update(num_steps=4, eval_every=4, checkpoint_every=4)
  workdir = str(tmp_path_factory.mktemp("reduced_lm"))
  out = train_lm.run(config, workdir)
  return config, workdir, out


def test_reduced_vocabulary_trains_and_round_trips_through_a_checkpoint(trained, data_dir):
  config, workdir, out = trained
  assert np.isfinite(out["train_loss"]) and np.isfinite(out["eval_loss"])
  cfg, params = loading.load_model(common.model(checkpoint=workdir), ByteTokenizer())
  stream = pipeline.token_stream("spec_jax_shakespeare", "train", ByteTokenizer(),
                                 data_dir=data_dir)
  assert cfg.head_ids == draft_init.top_ids(draft_init.count_tokens(stream, 257), 40)
  assert params["lm_head"]["kernel"].shape == (cfg.d_model, 40)
  # A mapping from another tokenizer is refused, naming the field.
  with pytest.raises(ValueError, match="drafter.checkpoint"):
    loading.load_model(common.model(checkpoint=workdir), get_tokenizer("smollm2"),
                       field="drafter.checkpoint")


@pytest.mark.parametrize("size, message", [
    ("test-tiny:layers=0+5", r"drafter.size keeps layers \[5\] but the model has 2 layers"),
    ("test-tiny:layers=1+1", "lists a layer twice"),
    ("test-tiny:vocab=300", "reduced vocabulary of 300 tokens but the tokenizer has 257"),
    ("test-tiny:depth=2", "unknown option 'depth=2'"),
    ("test-tiny:first=2:every=2", "choose one of"),
])
def test_bad_sizes_name_the_field(trained, size, message):
  _, workdir, _ = trained
  model = common.model(size=size, checkpoint=workdir)
  with pytest.raises(ValueError, match=message):
    loading.resolve_model(model, ByteTokenizer(), field="drafter.checkpoint",
                          token_counts=lambda: np.ones(257))


def test_bad_vocabularies_name_the_field():
  cfg, params = testing.tiny_model(vocab_size=20)
  with pytest.raises(ValueError, match="more than once"):
    draft_init.reduce_vocab(cfg, params, [1, 2, 2])
  with pytest.raises(ValueError, match="another tokenizer"):
    draft_init.reduce_vocab(cfg, params, [1, 25])
  with pytest.raises(ValueError, match="1..20 token ids"):
    draft_init.reduce_vocab(cfg, params, list(range(21)))
  # Layers of nothing, and a vocabulary with no counts to choose it from.
  tok = ByteTokenizer()
  with pytest.raises(ValueError, match="model.checkpoint is empty"):
    loading.resolve_model(common.model(size="test-tiny:first=1"), tok)
  with pytest.raises(ValueError, match="build it with train_lm or distill"):
    loading.resolve_model(common.model(size="test-tiny:vocab=8"), tok)
