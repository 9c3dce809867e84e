"""BPD heads (models/bpd_heads.py) and BPD decoding as a drafter (decoding/drafters/bpd.py):
shapes and the shared projection, zero-initialised heads = the verifier's next-token logits,
greedy output = verifier greedy at batch > 1, sampling lossless (chi-square, with a planted bug
that must fail) for chains and for lattice trees of every tree method, heads split over a mesh
decode like one device, bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import parallel, testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, methods
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import bpd, standard
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import bpd_heads, llama
from spec_jax.training import bpd as bpd_train

V = 8
PROMPTS = [[1, 2, 3, 4, 5], [4], [5, 0], [3, 3, 3]]


def _verifier(tie=True, vocab=V, seed=0):
  return testing.tiny_model(seed=seed, vocab_size=vocab, sharpness=3.0, tie_embeddings=tie)


@functools.cache
def _verifier_pass(v_cfg):
  """bpd_train._verifier_pass of the verifier, jitted once per config, as in the training step."""
  return jax.jit(functools.partial(bpd_train._verifier_pass, llama.make_apply(v_cfg, (-1,))))


_head_logits = jax.jit(bpd_heads.head_logits, static_argnames=("cfg", "v_cfg"))
_loss_fn = jax.jit(bpd_train.loss_fn, static_argnames=("cfg", "v_cfg", "objective"))


def _random_heads(cfg, v_cfg, v_params, seed=1, scale=1.0):
  """Heads that are not the identity (W2 random), so each head has its own law."""
  params = bpd_heads.init_params(cfg, jax.random.key(seed), v_cfg, v_params)
  k1, k2 = jax.random.split(jax.random.key(seed + 100))
  params["w1"] = scale * jax.random.normal(k1, params["w1"].shape) / np.sqrt(cfg.d_model)
  params["w2"] = scale * jax.random.normal(k2, params["w2"].shape) / np.sqrt(cfg.width)
  return params


@pytest.mark.parametrize("tie, own", [(True, False), (False, False), (True, True)])
def test_zero_initialised_heads_are_the_verifiers_next_token_logits(tie, own):
  v_cfg, v_params = _verifier(tie=tie, vocab=64)
  cfg = bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads=3, hidden=16, own_projection=own)
  params = bpd_heads.init_params(cfg, jax.random.key(0), v_cfg, v_params)
  assert {k: v.shape for k, v in params.items()} == {
      "w1": (3, 32, 16), "b1": (3, 16), "w2": (3, 16, 32), **({"out": (3, 32, 64)} if own else {})}
  tokens = np.asarray([[5, 9, 2, 33, 7]], np.int32)
  logits, hidden, _ = testing.jitted_apply(v_cfg, (-1,))(v_params, tokens, np.arange(5, dtype=np.int32)[None])
  heads = np.asarray(_head_logits(cfg, params, v_cfg, bpd_heads.verifier_output(v_cfg, v_params),
                                  hidden[-1]))                         # [1, 5, 3, 64]
  for k in range(3):
    np.testing.assert_allclose(heads[:, :, k], logits, atol=1e-5)
  # The shared projection is the verifier's own arrays, not a copy.
  out = bpd_heads.verifier_output(v_cfg, v_params)
  assert out["final_norm"] is v_params["final_norm"]


def _drafter(num_heads=3, tie=True, seed=1):
  v_cfg, v_params = _verifier(tie=tie)
  cfg = bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads=num_heads, hidden=16)
  drafter = bpd.BPDDrafter(cfg, v_cfg)
  d_params = drafter.params(_random_heads(cfg, v_cfg, v_params, seed=seed), v_params)
  return v_cfg, v_params, drafter, d_params


def _run(v_cfg, v_params, drafter, d_params, prompts, sampling, n, seed=0, mesh=None):
  return loop.speculative_generate(
      v_params, d_params, prompts, jax.random.key(seed),
      verifier=verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers), drafter=drafter,
      sampling=sampling, max_new_tokens=n, mesh=mesh)


def test_greedy_bpd_equals_verifier_greedy_at_batch_4():
  v_cfg, v_params, drafter, d_params = _drafter()
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=12)
  out = _run(v_cfg, v_params, drafter, d_params, prompts, Sampling(), 12)
  assert out.new_tokens() == ar.new_tokens()
  accepted = np.asarray(out.stats.accepted)
  assert accepted.sum() > 0 and (accepted < np.asarray(out.stats.verifier_calls) * 3).any()


TREES = {"rsd_c": standard.tree("rsd_c", depth=3, branching=(2, 2, 1)),
         "rsd_s": standard.tree("rsd_s", depth=2, width=3),
         "specinfer": standard.tree("specinfer", depth=2, width=3),
         "spectr": standard.tree("spectr", depth=2, width=3)}


@pytest.mark.parametrize("method", sorted(TREES))
def test_lattice_trees_greedy_and_lossless(method):
  """Draft trees from the heads' lattice (children at depth d from head d's law): greedy output
  equals the verifier's at batch 4; sampled output follows the verifier's exact law."""
  v_cfg, v_params, chain_drafter, d_params = _drafter()
  drafter = bpd.BPDDrafter(chain_drafter.heads, v_cfg, tree=TREES[method])
  assert drafter.shape == TREES[method]
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=12)
  assert _run(v_cfg, v_params, drafter, d_params, prompts, Sampling(), 12).new_tokens() == (
      ar.new_tokens())
  law = testing.exact_sequence_law(v_cfg, v_params, [1, 4, 2], 2, Sampling(1.0))
  many = generate_lib.pad_prompts([[1, 4, 2]] * 2000, 3, pad_id=0)
  out = _run(v_cfg, v_params, drafter, d_params, many, Sampling(1.0), 2, seed=2)
  assert testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law) > 1e-3
  assert np.sum(out.stats.accepted) > 300


@dataclasses.dataclass(frozen=True)
class _ShiftedLawDrafter(bpd.BPDDrafter):
  """Planted bug: drafts from each head's law but reports head k + 1's law as q."""

  def propose(self, params, x, tokens, lengths, rng, sampling):
    proposal, x = super().propose(params, x, tokens, lengths, rng, sampling)
    return dataclasses.replace(proposal, q=jnp.roll(proposal.q, 1, axis=1)), x


@dataclasses.dataclass(frozen=True)
class _UntransformedLawDrafter(bpd.BPDDrafter):
  """Planted bug: reports each head's raw softmax as q, not the temperature/top-k law its drafts
  were drawn from."""

  def propose(self, params, x, tokens, lengths, rng, sampling):
    proposal, new_x = super().propose(params, x, tokens, lengths, rng, sampling)
    raw, _ = super().propose(params, x, tokens, lengths, rng, Sampling(1.0))
    return dataclasses.replace(proposal, q=raw.q), new_x


@pytest.mark.parametrize("method", sorted(TREES))
def test_lattice_trees_are_lossless_under_a_transform_and_a_raw_q_is_caught(method):
  """Each lattice tree at T = 0.8 with top-k 4 follows the verifier's law of 2 tokens; the same
  tree reporting each head's raw softmax as q (not the law its nodes were drawn from) fails it."""
  v_cfg, v_params, chain_drafter, d_params = _drafter()
  sampling = Sampling(0.8, top_k=4)
  law = testing.exact_sequence_law(v_cfg, v_params, [1, 4, 2], 2, sampling)
  many = generate_lib.pad_prompts([[1, 4, 2]] * 2000, 3, pad_id=0)
  for cls, lossless in ((bpd.BPDDrafter, True), (_UntransformedLawDrafter, False)):
    out = _run(v_cfg, v_params, cls(chain_drafter.heads, v_cfg, tree=TREES[method]), d_params,
               many, sampling, 2, seed=2)
    p = testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law)
    assert np.sum(out.stats.accepted) > 300
    assert (p > 1e-3) if lossless else (p < 1e-6), (cls.__name__, p)


@pytest.mark.parametrize("buggy, sampling", [
    (False, Sampling(1.0)), (True, Sampling(1.0)),
    (False, Sampling(0.8, top_k=4)), ("untransformed", Sampling(0.8, top_k=4))])
def test_sampled_bpd_is_lossless(buggy, sampling):
  """3000 continuations of 2 tokens against the verifier's enumerated law (chi-square), at T = 1
  and under a temperature and top-k; a drafter whose q is not the law its drafts came from (the
  next head's, or the law before the transform) must fail the same test."""
  v_cfg, v_params, drafter, d_params = _drafter(num_heads=2)
  if buggy:
    cls = _UntransformedLawDrafter if buggy == "untransformed" else _ShiftedLawDrafter
    drafter = cls(drafter.heads, drafter.v_cfg)
  law = testing.exact_sequence_law(v_cfg, v_params, [1, 4, 2], 2, sampling)
  many = generate_lib.pad_prompts([[1, 4, 2]] * 3000, 3, pad_id=0)
  out = _run(v_cfg, v_params, drafter, d_params, many, sampling, 2, seed=1)
  p = testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law)
  assert np.sum(out.stats.accepted) > 300  # drafts were accepted, not just bonus tokens
  assert (p < 1e-4) if buggy else (p > 1e-3)


def test_heads_on_a_mesh_split_their_stack_and_decode_like_one_device():
  """Decoding on a mesh (data 2 x fsdp 2 x tensor 2) places the 4 stacked heads, own projections
  included, with their head axis over 'tensor' and the model width over 'fsdp'
  (parallel.HEAD_ROLES), as evaluate and the decoding loop place them: the heads' logits equal
  one device's, and greedy BPD decoding on the mesh is the verifier's greedy output."""
  v_cfg, v_params = _verifier(vocab=64)
  cfg = bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads=4, hidden=16, own_projection=True)
  drafter = bpd.BPDDrafter(cfg, v_cfg)
  d_params = drafter.params(_random_heads(cfg, v_cfg, v_params), v_params)
  mesh = parallel.make_mesh(dict(data=2, fsdp=2, tensor=2))
  placed = parallel.place_params(d_params, mesh)
  spec = jax.sharding.PartitionSpec
  assert {k: v.sharding.spec for k, v in placed["heads"].items()} == {
      "w1": spec("tensor", "fsdp", None), "b1": spec("tensor", None),
      "w2": spec("tensor", None, "fsdp"), "out": spec("tensor", None, "fsdp")}
  x = jax.random.normal(jax.random.key(3), (8, v_cfg.d_model))
  want = _head_logits(cfg, d_params["heads"], v_cfg, d_params["out"], x)
  got = _head_logits(cfg, placed["heads"], v_cfg, placed["out"], x)
  np.testing.assert_allclose(got, want, atol=1e-5)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=8)
  out = _run(v_cfg, v_params, drafter, d_params, prompts, Sampling(), 8, mesh=mesh)
  assert out.new_tokens() == ar.new_tokens()
  assert len(out.tokens.sharding.device_set) == 8


@pytest.mark.parametrize("loss, own, subset", [
    ("fkl", False, False), ("ce", False, False), ("fkl", True, False),
    ("fkl", False, True), ("ce", False, True), ("fkl", True, True)])
def test_training_loss_matches_a_numpy_reference(loss, own, subset):
  """The heads' training loss against a NumPy reference from the all-heads logits: head k at t
  targets t + 1 + k (fkl: KL(p_{t+k} || q_{k,t}); ce: the corpus token), positions past the end and
  zero weights weigh 0, head k weighs 0.8^(k-1). Training projects one head at a time, so this also
  checks that path against `head_logits`. subset (bpd.train_vocab): p and q renormalised over 40
  of the 64 tokens, corpus targets outside them weigh 0, top-1 still against the verifier's
  greedy token over all 64."""
  v_cfg, v_params = _verifier(vocab=64)
  cfg = bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads=3, hidden=16, own_projection=own)
  params = _random_heads(cfg, v_cfg, v_params)
  if own:
    params["out"] = params["out"] + 0.3 * jax.random.normal(jax.random.key(7), params["out"].shape)
  tokens = np.asarray(jax.random.randint(jax.random.key(4), (2, 9), 0, 64))
  weights = np.ones((2, 9), np.float32)
  weights[1, 6:] = 0.0
  batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "weights": weights}
  objective = bpd_train.Objective(loss, decay=0.8)
  x, log_p = _verifier_pass(v_cfg)(v_params, tokens)
  out = bpd_heads.verifier_output(v_cfg, v_params)
  ids = np.sort(np.random.default_rng(0).permutation(64)[:40]).astype(np.int32) if subset else None
  got, metrics = _loss_fn(
      params, x, log_p, batch, cfg=cfg, v_cfg=v_cfg, objective=objective,
      v_out=out if ids is None else bpd_heads.verifier_output(v_cfg, v_params, ids),
      vocab_ids=ids)
  logits = np.asarray(_head_logits(cfg, params, v_cfg, out, x), np.float64)
  log_p, targets = np.asarray(log_p, np.float64), np.asarray(batch["targets"])
  greedy = log_p.argmax(-1)
  keep = np.arange(64) if ids is None else ids

  def lse(a):
    top = a.max(-1, keepdims=True)
    return np.log(np.sum(np.exp(a - top), -1, keepdims=True)) + top

  log_q = logits[..., keep] - lse(logits[..., keep])
  log_ps = log_p[..., keep] - lse(log_p[..., keep])
  if subset:
    assert not set(targets.ravel()) <= set(ids)   # some corpus targets fall outside
  per_head = []
  for j in range(3):
    k = j + 1
    num = den = agree = 0.0
    for b in range(2):
      for t in range(9 - k):
        w = weights[b, t + k]
        if loss == "fkl":
          term = np.sum(np.exp(log_ps[b, t + k]) * (log_ps[b, t + k] - log_q[b, t, j]))
        elif targets[b, t + k] in keep:
          term = -log_q[b, t, j, list(keep).index(targets[b, t + k])]
        else:
          term, w = 0.0, 0.0
        num += w * term
        den += w
        agree += w * (keep[log_q[b, t, j].argmax()] == greedy[b, t + k])
    per_head.append(num / den)
    np.testing.assert_allclose(metrics[f"head{k}_loss"], per_head[-1], rtol=1e-4)
    np.testing.assert_allclose(metrics[f"head{k}_top1"], agree / den, rtol=1e-5)
  decay = 0.8 ** np.arange(3)
  np.testing.assert_allclose(got, np.sum(decay * per_head) / np.sum(decay), rtol=1e-4)


def test_bad_input_names_the_field():
  v_cfg, v_params = _verifier()
  with pytest.raises(ValueError, match=r"bpd.num_heads=0: give at least one head"):
    bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads=0)
  other_cfg, _ = _verifier(vocab=16)
  cfg = bpd_heads.BPDConfig.for_verifier(other_cfg, num_heads=2)
  heads = bpd_heads.init_params(cfg, jax.random.key(0))
  with pytest.raises(ValueError, match=r"BPD heads for a verifier of width 32 and 16 tokens "
                                       r"cannot run on this verifier \(width 32, 8 tokens\)"):
    bpd.BPDDrafter(cfg, v_cfg).params(heads, v_params)
  cfg = bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads=3)
  with pytest.raises(ValueError, match=r"head parameters have shapes"):
    bpd_heads.check(cfg, bpd_heads.init_params(
        bpd_heads.BPDConfig.for_verifier(v_cfg, num_heads=2), jax.random.key(0)), v_cfg)


def test_train_bpd_resumes_and_records_its_verifier(tmp_path):
  """train_bpd end to end on the tiny verifier: the loss falls, per-head held-out metrics, resume;
  the checkpoint carries the heads' config with the verifier's fingerprint, and a draft deeper
  than h is refused by evaluate's drafter factory. (Decoding with trained heads in evaluate, every
  BPD method included, is tests/test_bpd_experiment.py's smoke.)"""
  from configs import train_bpd as train_bpd_config
  from spec_jax import loading
  from spec_jax.programs import train_bpd
  from spec_jax.training import metrics as metrics_lib
  heads_dir = str(tmp_path / "heads")
  result = train_bpd.run(train_bpd_config.get_config("smoke"), heads_dir)
  assert result["step"] == 20
  assert {f"head{k}_{m}" for k in (1, 2, 3) for m in ("loss", "top1", "topk")} <= set(
      result["eval"])
  losses = [r["train/loss"] for r in metrics_lib.read_jsonl(f"{heads_dir}/metrics.jsonl")
            if "train/loss" in r]
  assert losses[-1] < losses[0]
  assert train_bpd.run(train_bpd_config.get_config("smoke"), heads_dir)["step"] == 20  # resumed
  other = train_bpd_config.get_config("smoke")
  other.bpd.num_heads = 2
  with pytest.raises(ValueError, match=r"other `bpd` settings .*num_heads: saved 3, this run 2"):
    train_bpd.run(other, heads_dir)
  config = train_bpd_config.get_config("smoke")
  config.verifier.checkpoint = heads_dir
  b_cfg = loading.drafter_bpd(config.verifier)
  assert b_cfg.num_heads == 3 and len(b_cfg.verifier_probe) == bpd_heads.PROBE_LOGITS
  v_cfg, v_params = testing.tiny_model(seed=0)
  with pytest.raises(ValueError,
                     match="holds 3 BPD heads: they draft chains and trees of depth at most 3"):
    methods.check(methods.parse("sd@4", None), methods.Source(kind="bpd", b_cfg=b_cfg),
                  Sampling(0.0))


def test_train_bpd_over_a_token_subset(tmp_path):
  """bpd.train_vocab: the loss over the train split's N most frequent tokens trains (the held-out
  metrics stay over the whole vocabulary); a negative N or one past the vocabulary is refused
  naming the field."""
  from configs import train_bpd as train_bpd_config
  from spec_jax.programs import train_bpd
  config = train_bpd_config.get_config("smoke")
  config.bpd.train_vocab = 48
  config.train.update(num_steps=6, eval_every=6, checkpoint_every=6)
  result = train_bpd.run(config, str(tmp_path / "sub"))
  assert result["step"] == 6 and np.isfinite(result["train_loss"])
  assert 0.0 <= result["eval"]["head1_top1"] <= 1.0
  for bad, message in ((-1, r"bpd.train_vocab=-1 must be >= 0"),
                       (100_000, r"bpd.train_vocab=100000 exceeds the verifier's vocabulary")):
    config.bpd.train_vocab = bad
    with pytest.raises(ValueError, match=message):
      train_bpd.run(config, str(tmp_path / f"bad{bad}"))


def test_head_analysis_oracle_at_k1_is_greedy_bpd_tau():
  """The lattice oracle with k = 1 is exactly greedy BPD decoding (chains of h): same τ as the
  loop measures; larger k can only help; statistics are in range."""
  from spec_jax.evaluation import bpd_analysis
  v_cfg, v_params, drafter, d_params = _drafter()
  n = 12
  stats = bpd_analysis.analyse(drafter.heads, d_params["heads"], v_cfg, v_params, PROMPTS, n,
                               ks=(1, 2, 8))
  out = _run(v_cfg, v_params, drafter, d_params, generate_lib.pad_prompts(PROMPTS, 8, 0),
             Sampling(), n)
  tau = len(PROMPTS) * n / int(np.sum(out.stats.verifier_calls))
  assert stats["oracle_tau"][1] == pytest.approx(tau, abs=1e-4)
  assert stats["oracle_tau"][1] <= stats["oracle_tau"][2] <= stats["oracle_tau"][8]
  assert stats["oracle_tau"][8] > stats["oracle_tau"][1]  # 8 of 8 tokens: every draft is in
  assert all(0 <= e <= np.log(V) + 1e-6 for e in stats["head_entropy"])
  assert 0 <= stats["repetition_rate"] <= 1
  assert all(a <= b for a, b in zip(stats["topk_accuracy"][1], stats["topk_accuracy"][2]))
  assert stats["topk_accuracy"][8] == [1.0, 1.0, 1.0]
