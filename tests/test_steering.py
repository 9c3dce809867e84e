"""SD² steering (`models/steering.py`, `decoding/drafters/steered.py`, `training/steering.py`):
a fresh module leaves the drafter exactly as pretrained, W_hml starts as the sum of the three
features, the staleness offsets match a hand-checked table, δ is read at the last accepted node,
steered greedy SD equals the verifier's greedy output, and steered chains and trees are lossless
(chi-square; a planted bug that reports the unsteered law fails it)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import testing
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import loop, methods
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import standard, steered, trees
from spec_jax.decoding.protocols import Verdict
from spec_jax.decoding.sampling import Sampling
from spec_jax.models import llama, steering
from spec_jax.training import steering as steering_train

V = 6
LAYERS = (0, 1, 2)  # test-tiny has 2 layers: the embedding output, the middle, the final residual


def _models(vocab_size=V, strength=0.0, mode="merged", seed=3, sharpness=3.0, sigma=None):
  """(v_cfg, v_params, drafter, d_params): tiny verifier and drafter (another random model, or
  the verifier perturbed by N(0, sigma²)), a steering module whose W_g is N(0, strength²)
  (0: the fresh, no-op module)."""
  v_cfg, v_params = testing.tiny_model(seed=0, vocab_size=vocab_size, sharpness=sharpness)
  d_cfg, d_params = testing.tiny_model(seed=5, vocab_size=vocab_size, sharpness=sharpness)
  if sigma:
    d_params = testing.perturbed(v_params, sigma)
  s_cfg = steering.make_config(v_cfg, d_cfg, LAYERS, mode)
  s_params = steering.init_params(s_cfg)
  if strength:
    s_params["w_g"] = strength * jax.random.normal(jax.random.key(seed), s_params["w_g"].shape)
  return v_cfg, v_params, steered.SteeredDrafter(d_cfg, s_cfg), {"drafter": d_params,
                                                                  "steering": s_params}


def test_fresh_module_leaves_the_drafter_exactly_as_pretrained():
  v_cfg, v_params, drafter, params = _models()
  tokens = jnp.asarray([[1, 4, 2, 5, 0, 3]])
  pos = jnp.arange(6)[None]
  _, hidden, _ = llama.make_apply(v_cfg, LAYERS)(v_params, tokens, pos)
  steer = steering.steer_from_hidden(drafter.steering, params["steering"], hidden)
  assert steer["up"].shape == (2, 1, 6, 64)
  apply = llama.make_apply(drafter.cfg)
  plain, _, _ = apply(params["drafter"], tokens, pos)
  fresh, _, _ = apply(params["drafter"], tokens, pos, steer=steer)
  np.testing.assert_array_equal(np.asarray(fresh), np.asarray(plain))
  _, _, _, strong = _models(strength=0.5)
  steer = steering.steer_from_hidden(drafter.steering, strong["steering"], hidden)
  moved, _, _ = apply(params["drafter"], tokens, pos, steer=steer)
  assert np.abs(np.asarray(moved) - np.asarray(plain)).max() > 0.1  # steering reaches the logits
  for mode in ("simple",):
    _, _, d2, p2 = _models(strength=0.5, mode=mode)
    steer = steering.steer_from_hidden(d2.steering, p2["steering"], hidden)
    assert steer["residual"].shape == (2, 1, 6, 32)
    moved, _, _ = apply(params["drafter"], tokens, pos, steer=steer)
    assert np.abs(np.asarray(moved) - np.asarray(plain)).max() > 0.1


def test_hml_starts_as_the_sum_of_the_three_features():
  cfg = steering.SteeringConfig((3, 15, 27), d_verifier=4, drafter_layers=2, width=8)
  params = steering.init_params(cfg)
  h = [jax.random.normal(jax.random.key(i), (2, 5, 4)) for i in range(3)]
  np.testing.assert_allclose(steering.guidance(params, h), h[0] + h[1] + h[2], rtol=1e-6)
  assert steering.default_layers(30) == (3, 15, 27)


def test_staleness_offsets_hand_checked():
  # Position t is steered by the features at max(t − o, 0).
  table = {1: [0, 0, 1, 2, 3, 4], 2: [0, 0, 0, 1, 2, 3], 4: [0, 0, 0, 0, 0, 1]}
  for offset, want in table.items():
    np.testing.assert_array_equal(steering_train.stale_positions(6, offset), want)
  # Training draws o ∈ {1..γ}; evaluation uses the freshest (o = 1).
  cfg = steering.SteeringConfig((0,), 4, 2, 8)
  _, context_fn = steering_train.make_student(cfg, llama.model_config("test-tiny"), 3)
  batch = {"weights": jnp.ones((1, 4))}
  seen = {int(context_fn({}, batch, jax.random.key(i))["offset"]) for i in range(60)}
  assert seen == {1, 2, 3}
  assert int(context_fn({}, batch, None)["offset"]) == 1
  with pytest.raises(ValueError, match="steering.max_offset=0"):
    steering_train.make_student(cfg, llama.model_config("test-tiny"), 0)


def test_steered_positions_outside_the_response_get_no_delta():
  """δ_t = 0 where the next token is not a response token: the drafter's logits there equal
  the unsteered ones; elsewhere they move."""
  v_cfg, v_params, drafter, params = _models(strength=0.5)
  tokens = jnp.asarray([[1, 4, 2, 5, 0, 3]])
  pos = jnp.arange(6)[None]
  _, hidden, _ = llama.make_apply(v_cfg, LAYERS)(v_params, tokens, pos)
  weights = jnp.asarray([[0, 0, 1, 1, 1, 0]], jnp.float32)
  logits, _, _ = steering_train.steered_apply(
      params, tokens, pos, hidden=hidden, weights=weights, offset=2, cfg=drafter.steering,
      drafter_apply=llama.make_apply(drafter.cfg))
  plain, _, _ = llama.make_apply(drafter.cfg)(params["drafter"], tokens, pos)
  diff = np.abs(np.asarray(logits - plain)).max(-1)[0]
  # Causal attention carries δ forward, so only positions before the first steered one match.
  np.testing.assert_array_equal(diff[:2], 0.0)
  assert (diff[2:5] > 1e-3).all()


def test_delta_is_read_at_the_last_accepted_node():
  """A verifier whose hidden state at node m encodes m: the committed δ is the module applied
  to the deepest accepted node's features (the root when nothing was accepted)."""
  _, _, drafter, params = _models(strength=0.5)
  b, m, d = 3, 4, 32
  # A direction per node (LayerNorm would erase a mere scale).
  enc = jnp.cos(jnp.arange(m)[:, None] * 0.7 * jnp.arange(d)[None] + 0.3)
  hidden = {l: jnp.broadcast_to(enc[None] * (l + 1), (b, m, d)) for l in LAYERS}
  verdict = Verdict(num_accepted=jnp.asarray([0, 2, 3]), next_token=jnp.zeros(b, jnp.int32),
                    path=jnp.asarray([[0, 0, 0], [1, 2, 0], [1, 2, 3]]),
                    reached=jnp.ones((b, 3), bool), alpha=jnp.zeros((b, 3)),
                    num_candidates=jnp.ones((b, 3), jnp.int32), chain=True)
  cache = llama.init_cache(drafter.cfg, b, 8)
  state = drafter.commit(params, {"cache": cache, "steer": None}, None, verdict,
                         jnp.full((b,), 3), hidden)
  for row, node in enumerate([0, 2, 3]):
    want = steering.steer_from_hidden(drafter.steering, params["steering"],
                                      {l: hidden[l][row:row + 1, node] for l in LAYERS})
    np.testing.assert_allclose(state["steer"]["up"][:, row], want["up"][:, 0], rtol=1e-5,
                               atol=1e-8)
  assert not np.allclose(state["steer"]["up"][:, 1], state["steer"]["up"][:, 2])


def test_the_first_draft_is_steered_at_the_offset_training_reads():
  """The first round's root is the last prompt token (position L − 1); training steers it with
  the features at L − 2 (o = 1) and leaves the prompt before it unsteered. The decoded first
  draft's law is that teacher-forced law, not one steered by the root's own features (o = 0)."""
  v_cfg, v_params, drafter, params = _models(strength=0.5)
  drafter = steered.SteeredDrafter(drafter.cfg, drafter.steering, trees.chain(1))
  tokens = jnp.asarray([[1, 4, 2, 5, 0, 0]])
  lengths = jnp.asarray([4])
  _, hidden, _ = llama.make_apply(v_cfg, LAYERS)(v_params, tokens, jnp.arange(6)[None])
  state = drafter.init(params, tokens, lengths, 12, hidden)
  proposal, _ = drafter.propose(params, state, tokens, lengths, jax.random.key(0),
                                Sampling(temperature=1.0))
  weights = jnp.asarray([[0, 0, 0, 1, 0, 0]], jnp.float32)
  want = {}
  for offset in (1, 0):
    logits, _, _ = steering_train.steered_apply(
        params, tokens, jnp.arange(6)[None], hidden=hidden, weights=weights, offset=offset,
        cfg=drafter.steering, drafter_apply=llama.make_apply(drafter.cfg))
    want[offset] = np.asarray(jax.nn.softmax(logits[0, 3]))
  got = np.asarray(proposal.q[0, 0])
  np.testing.assert_allclose(got, want[1], rtol=1e-5, atol=1e-7)
  assert np.abs(want[0] - want[1]).max() > 1e-3  # offset 0 would be told apart


def test_the_catch_up_writes_a_fed_draft_again_with_the_deltas_it_was_fed_with():
  """The next round's catch-up window rewrites slot L − 2. Where a draft was fed there (an
  accepted draft before the last), it is written with the deltas of the round that fed it, so
  the cache is what that round left: training never steers a position by its own features."""
  v_cfg, v_params, drafter, params = _models(strength=0.5)
  drafter = steered.SteeredDrafter(drafter.cfg, drafter.steering, trees.chain(2))
  tokens = jnp.asarray([[1, 4, 2, 5, 0, 0, 0, 0]])
  _, hidden, _ = llama.make_apply(v_cfg, LAYERS)(v_params, tokens, jnp.arange(8)[None])
  state = drafter.init(params, tokens, jnp.asarray([4]), 12, hidden)
  proposal, state = drafter.propose(params, state, tokens, jnp.asarray([4]), jax.random.key(0),
                                    Sampling(temperature=1.0))
  fed = state["cache"]  # slots 3 (root) and 4 (the first draft, fed for the second)
  d1 = int(proposal.tokens[0, 1])
  tokens = tokens.at[0, 4].set(d1).at[0, 5].set(3)  # the first draft accepted, then token 3
  verdict = Verdict(num_accepted=jnp.asarray([1]), next_token=jnp.asarray([3]),
                    path=jnp.asarray([[1, 0]]), reached=jnp.ones((1, 2), bool),
                    alpha=jnp.zeros((1, 2)), num_candidates=jnp.ones((1, 2), jnp.int32),
                    chain=True)
  v_hidden = {l: jnp.take(hidden[l], jnp.asarray([3, 4, 5]), axis=1) for l in LAYERS}
  state = drafter.commit(params, state, proposal, verdict, jnp.asarray([6]), v_hidden)
  _, state = drafter.propose(params, state, tokens, jnp.asarray([6]), jax.random.key(1),
                             Sampling(temperature=1.0))
  for name in ("k", "v"):
    np.testing.assert_allclose(getattr(state["cache"], name)[:, :, 4],
                               getattr(fed, name)[:, :, 4], rtol=1e-5, atol=1e-6)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40], [100, 101, 102], [7, 7]]


def test_greedy_steered_sd_equals_verifier_greedy(shape=trees.chain(3)):
  v_cfg, v_params, drafter, params = _models(vocab_size=257, strength=0.3, sharpness=2.0,
                                             sigma=0.02)
  drafter = steered.SteeredDrafter(drafter.cfg, drafter.steering, shape)
  prompts = generate_lib.pad_prompts(PROMPTS, 8, pad_id=0)
  ar = generate_lib.generate(v_params, prompts, jax.random.key(0), cfg=v_cfg, sampling=Sampling(),
                             max_new_tokens=12)
  out = loop.speculative_generate(
      v_params, params, prompts, jax.random.key(0),
      verifier=verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers), drafter=drafter,
      sampling=Sampling(), max_new_tokens=12)
  assert out.new_tokens() == ar.new_tokens()
  accepted = np.asarray(out.stats.accepted)
  assert accepted.sum() > 0 and (accepted < np.asarray(out.stats.verifier_calls) * shape.depth).any()


class _UnsteeredLawDrafter(steered.SteeredDrafter):
  """Planted bug: drafts with the steering but reports the unsteered drafter's law as q."""

  def propose(self, params, state, tokens, lengths, rng, sampling):
    proposal, new_state = super().propose(params, state, tokens, lengths, rng, sampling)
    plain, _ = self._lm.propose(params["drafter"], state["cache"], tokens, lengths, rng, sampling)
    return proposal.replace(q=plain.q), new_state


def _law_check(shape, cls=steered.SteeredDrafter):
  v_cfg, v_params, drafter, params = _models(strength=2.0)
  drafter = cls(drafter.cfg, drafter.steering, shape)
  return testing.sd_law_pvalue(v_cfg, v_params, drafter, params, [1, 4, 2])


@pytest.mark.parametrize("shape", [
    trees.chain(2), standard.tree("rsd_c", 2, (2, 1)), standard.tree("rsd_s", 2, width=2),
    standard.tree("specinfer", 2, width=2), standard.tree("spectr", 2, width=2)],
    ids=lambda s: s.describe())
def test_steered_sampling_is_lossless(shape):
  assert _law_check(shape) > 1e-3


@pytest.mark.parametrize("shape", [trees.chain(2), standard.tree("rsd_s", 2, width=2)],
                         ids=lambda s: s.describe())
def test_reporting_the_unsteered_law_is_caught(shape):
  assert _law_check(shape, _UnsteeredLawDrafter) < 1e-6


def _stop_law_pvalue(cls=steered.SteeredDrafter):
  """sd_stop over the steered drafter (γ = 3, rows stopping below 0.5): 3 tokens, so most
  continuations take a second round, steered from a window the first round's cut left."""
  v_cfg, v_params, drafter, params = _models(strength=2.0)
  drafter = cls(drafter.cfg, drafter.steering, trees.chain(3, stop=0.5))
  prompt = [1, 4, 2]
  out = testing.decode(v_cfg, v_params, drafter, params,
                       generate_lib.pad_prompts([prompt] * 4000, 3, pad_id=0), Sampling(1.0), 3)
  assert np.sum(out.stats.accepted) > 300                                          # accepted
  assert np.sum(out.stats.drafted) < 2.7 * np.sum(out.stats.verifier_calls)       # rows stop
  law = testing.exact_sequence_law(v_cfg, v_params, prompt, 3, Sampling(1.0))
  return testing.chi_square_pvalue([tuple(r) for r in out.new_tokens()], law)


def test_steered_sampling_with_a_stop_is_lossless():
  assert _stop_law_pvalue() > 1e-3


def test_reporting_the_unsteered_law_of_a_cut_chain_is_caught():
  assert _stop_law_pvalue(_UnsteeredLawDrafter) < 1e-6


def test_bad_input_names_the_field():
  v_cfg, _ = testing.tiny_model(vocab_size=V)
  d_cfg, _ = testing.tiny_model(vocab_size=V)
  with pytest.raises(ValueError, match=r"steering.verifier_layers asks for .* layer 7, but the "
                                      r"verifier has 2 layers"):
    steering.make_config(v_cfg, d_cfg, (0, 1, 7))
  with pytest.raises(ValueError, match="steering.mode='mixed' is not known"):
    steering.make_config(v_cfg, d_cfg, LAYERS, "mixed")
  with pytest.raises(ValueError, match="has no SwiGLU MLP"):
    steering.make_config(v_cfg, object(), LAYERS)
  s_cfg = steering.make_config(v_cfg, d_cfg, LAYERS)
  wider = llama.model_config("test-tiny", vocab_size=V, d_ff=96)
  with pytest.raises(ValueError, match=r"width 64 but the drafter has 2 layers with d_ff = 96"):
    steered.SteeredDrafter(wider, s_cfg)
  other = steering.make_config(llama.model_config("test-tiny", vocab_size=V, d_model=48,
                                                  head_dim=12), d_cfg, LAYERS)
  with pytest.raises(ValueError, match=r"reads a verifier of width 48 but this verifier has "
                                      r"d_model = 32"):
    steering.check_verifier(other, v_cfg, "drafter.checkpoint=x")
  with pytest.raises(ValueError, match=r"x: steering.verifier_layers asks for .* layer 2, but "
                                      r"the verifier has 1 layers"):
    steering.check_verifier(s_cfg, llama.model_config("test-tiny", vocab_size=V, n_layers=1),
                            "x")
  with pytest.raises(ValueError, match=r"steering module's shapes .* do not fit"):
    steering.check_params(s_cfg, steering.init_params(other), "drafter.checkpoint=x")


# ---------------------------------------------------------------------------------------------
# Training and the experiment: train_steering (distill with a steered student) and
# steering_experiment, on their smoke configs.

@pytest.fixture(scope="module")
def experiment(data_dir, tmp_path_factory):
  """The steering experiment's smoke run (trains `distilled` and `steered` from one drafter,
  evaluates all three, times the steering), dispatched as launch.py does, in this process:
  (config, workdir, rows)."""
  import json  # noqa: PLC0415
  from experiments.steering import config as experiment_config  # noqa: PLC0415
  from spec_jax import testing  # noqa: PLC0415
  config = experiment_config.get_config("smoke")
  config.train.data.data_dir = data_dir
  config.eval.data.data_dir = data_dir
  workdir = str(tmp_path_factory.mktemp("steering"))
  rows = testing.dispatch(config, workdir)
  with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
    assert json.load(f) == rows
  return config, workdir, rows


def test_experiment_smoke_writes_results_and_resumes(experiment, monkeypatch):
  """End to end (fixture); then a rerun that runs nothing."""
  import json  # noqa: PLC0415
  from spec_jax.programs import distill, evaluate, steering_experiment  # noqa: PLC0415
  config, workdir, rows = experiment
  sd = {(r["drafter"], r["temperature"], r["gamma"]) for r in rows if r["method"] == "sd"}
  assert sd == {(n, 1.0, 2) for n in ("pretrained", "distilled", "steered")}
  assert all(r["domain"] == "in" for r in rows)
  assert all(r["tau_se"] is not None for r in rows if r["method"] == "sd")
  md = open(os.path.join(workdir, "results.md")).read()
  assert "steered vs distilled (τ−1)" in md and "| Qwen3-8B / Qwen3-0.6B, T = 1 | 3.97" in md
  assert "goal ≥ +20%" in md and "Steering overhead at batch" in md
  assert "Not finished yet" not in md
  assert os.path.getsize(os.path.join(workdir, "accepted_tokens.png")) > 0
  overhead = json.load(open(os.path.join(workdir, "overhead.json")))
  assert overhead["batch_size"] == config.overhead_batch and overhead["steering_ms"] > 0
  assert overhead["round_ms"] > 0 and overhead["fraction"] is not None

  def refuse(*args, **kwargs):
    raise AssertionError("a finished piece was redone instead of read back")
  for module in (evaluate, distill):
    monkeypatch.setattr(module, "run", refuse)
  monkeypatch.setattr(steering_experiment, "steering_ms", refuse)
  again = steering_experiment.run(config, workdir)
  assert again == rows
  # The same report, but for the command (the launcher's had the data_dir overrides).
  assert open(os.path.join(workdir, "results.md")).read().split("`. Verifier")[1] == \
      md.split("`. Verifier")[1]


def _steering_rows(name, domain, t, tau, tokens_per_s=None):
  """One (drafter, domain, T) setting's evaluate rows at γ = 4 (no model): SD's τ ± 0.01."""
  return [dict(method="sd", gamma=4, temperature=t, block_efficiency=tau, tau_se=0.01,
               batch_size=4, tokens_per_s=tokens_per_s, device="cpu", verifier="v",
               drafter="runs/pre/drafter" if name == "pretrained" else f"runs/train/{name}")]


def test_experiment_render_only_reads_back_and_runs_nothing(tmp_path, monkeypatch):
  """Without models: render_only lists the unfinished evaluations (not the training runs that
  left no results behind); over finished ones it computes the gains, the goals, the overhead
  against the steered drafter's measured rounds and the plot's bars, and runs nothing."""
  import json  # noqa: PLC0415
  from experiments.steering import config as experiment_config  # noqa: PLC0415
  from spec_jax.evaluation import steering_report  # noqa: PLC0415
  from spec_jax.programs import distill, evaluate, steering_experiment  # noqa: PLC0415

  def refuse(*args, **kwargs):
    raise AssertionError("render_only ran something")
  for module in (evaluate, distill):
    monkeypatch.setattr(module, "run", refuse)
  monkeypatch.setattr(steering_experiment, "steering_ms", refuse)
  config = experiment_config.get_config()
  config.render_only = True
  config.lock()
  assert steering_experiment.run(config, str(tmp_path)) == []
  md = open(tmp_path / "results.md").read()
  assert "**Not finished yet: 10 runs** (eval_pretrained_in, eval_pretrained_out, " in md
  assert "train_" not in md and "overhead)" in md
  assert not os.path.exists(tmp_path / "accepted_tokens.png")  # no rows: nothing to plot

  finished = {"pretrained_in": _steering_rows("pretrained", "in", 1.0, 1.25),
              "distilled_in": _steering_rows("distilled", "in", 1.0, 1.5),
              "steered_in": _steering_rows("steered", "in", 1.0, 1.7, tokens_per_s=68.0),
              "pretrained_out": _steering_rows("pretrained", "out", 1.0, 1.2),
              "steered_out": _steering_rows("steered", "out", 1.0, 1.1, tokens_per_s=44.0)}
  for name, rows in {**{f"eval/{k}": v for k, v in finished.items()},
                     "overhead": [dict(batch_size=4, steering_ms=2.0)]}.items():
    os.makedirs(tmp_path / "runs" / name)
    json.dump(rows, open(tmp_path / "runs" / name / "results.json", "w"))
  rows = steering_experiment.run(config, str(tmp_path))
  assert {(r["drafter"], r["domain"], r["drafter_checkpoint"]) for r in rows} == {
      (k.rsplit("_", 1)[0], k.rsplit("_", 1)[1], v[0]["drafter"]) for k, v in finished.items()}
  assert json.load(open(tmp_path / "results.json")) == rows
  md = open(tmp_path / "results.md").read()
  assert "**Not finished yet: 4 runs** (eval_distilled_out, eval_steered_frozen_in, " in md
  assert "pretrained drafter `runs/pre/drafter`" in md  # what the rows measured
  blanks = " | ".join("–" for _ in config.steered_runs if _ != "steered")
  assert (f"| in | 1 | 4 | 1.250 ± 0.010 | 1.500 ± 0.010 | 1.700 ± 0.010 | {blanks} | +40.0% | "
          "+180.0% |") in md
  # SE of R = (τ_st − 1) / (τ_b − 1) by the delta method: √(0.01² + R² 0.01²) / (τ_b − 1),
  # R = 1.4 over 0.5 → 3.4%; R = 0.5 over 0.2 → 5.6% (not √2 · 0.01 / (τ_b − 1): 2.8%, 7.1%).
  assert ("- In domain, T = 1, γ = 4: steered vs distilled τ − 1 +40.0% (± 3.4%); goal ≥ "
          "+20%: met.") in md
  assert ("- Out of domain, T = 1, γ = 4: steered vs pretrained τ − 1 -50.0% (± 5.6%); goal "
          "no loss: not met.") in md
  # Rounds of 4 · τ / tokens_per_s: 4 · 1.7 / 68 = 4 · 1.1 / 44 = 100 ms.
  assert json.load(open(tmp_path / "overhead.json")) == dict(
      batch_size=4, steering_ms=2.0, round_ms=100.0, fraction=0.02)
  assert ("- Steering overhead at batch 4: 2.000 ms per round against a measured round of "
          "100.0 ms (2.00%); goal ≤ 5%: met.") in md
  assert os.path.getsize(tmp_path / "accepted_tokens.png") > 0
  tagged = [dict(r, drafter_name=r["drafter"]) for r in rows]
  series = steering_report.plot_series(config, tagged)
  assert list(series) == [("domain in (shakespeare), T = 1", n)
                          for n in ("pretrained", "distilled", "steered")] + [
      ("domain out (pystdlib), T = 1", n) for n in ("pretrained", "steered")]
  xs, ys, errs = series["domain in (shakespeare), T = 1", "steered"]
  assert xs == [4] and ys == pytest.approx([0.7]) and errs == [0.01]


def test_experiment_evaluations_depend_on_their_training():
  """A drafter trained again under another config is evaluated (and timed) again: its training
  run's digest is an input of its evaluations, though its checkpoint path stays the same."""
  from experiments.steering import config as experiment_config  # noqa: PLC0415
  from spec_jax.evaluation import experiment as harness  # noqa: PLC0415
  from spec_jax.programs import steering_experiment  # noqa: PLC0415

  def runs(steps):
    config = experiment_config.get_config("smoke")
    config.train.train.num_steps = steps
    return {r.name: r for r in steering_experiment.runs(config, "w")}
  before, after = runs(4), runs(5)
  assert list(before) == ["train_distilled", "train_steered", "eval_pretrained_in",
                          "eval_distilled_in", "eval_steered_in", "overhead"]
  assert before["eval_pretrained_in"].inputs == {}
  for name in ("eval_distilled_in", "eval_steered_in", "overhead"):
    assert before[name].config == after[name].config  # the same checkpoint path
    assert before[name].inputs != after[name].inputs, name
  assert before["eval_steered_in"].inputs == {
      "drafter": harness.run_digest(before["train_steered"])}


def test_experiment_bad_steered_run_is_named_before_anything_runs(tmp_path):
  from experiments.steering import config as experiment_config  # noqa: PLC0415
  from spec_jax.programs import steering_experiment  # noqa: PLC0415
  config = experiment_config.get_config("smoke")
  config.steered_runs.steered.mode = "mixed"
  with pytest.raises(ValueError, match="steering.mode='mixed' is not known"):
    steering_experiment.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")
  # Two batch sizes: the report's rows are per (drafter, domain, T, γ), one batch size.
  config = experiment_config.get_config("smoke")
  config.eval.eval.batch_sizes = (1, 4)
  with pytest.raises(ValueError, match=r"eval.eval.batch_sizes=\(1, 4\): the steering report"):
    steering_experiment.run(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "runs")


def test_steered_checkpoint_loads_with_its_module_and_continues_frozen(experiment, tmp_path):
  from spec_jax import loading  # noqa: PLC0415
  from spec_jax.programs import train_steering  # noqa: PLC0415
  from spec_jax.training import checkpoints, metrics as metrics_lib  # noqa: PLC0415
  config, workdir, _ = experiment
  steered_dir = os.path.join(workdir, "runs", "train", "steered")
  losses = [r["train/loss"] for r in metrics_lib.read_jsonl(steered_dir) if "train/loss" in r]
  assert len(losses) == 4 and losses[-1] < losses[0]  # it learned something
  # The checkpoint: drafter + module, the module's config in the meta; evaluate builds the
  # steered drafter from it.
  cfg, params, meta = checkpoints.load_model(steered_dir)
  assert set(params) == {"drafter", "steering"}
  s_cfg = checkpoints.steering_from_meta(meta)
  assert s_cfg.verifier_layers == (0, 1, 2) and s_cfg.mode == "merged"  # low/mid/high of 2
  assert np.abs(np.asarray(params["steering"]["w_g"])).max() > 0  # W_g moved off zero
  section = config.train.drafter.copy_and_resolve_references()
  section.checkpoint = steered_dir
  assert loading.drafter_steering(section) == s_cfg
  source = methods.Source(kind="steered", s_cfg=s_cfg, d_cfg=cfg, d_params=params)
  built = methods.build(methods.parse("sd@2", None), source)
  assert isinstance(built.drafter, steered.SteeredDrafter)
  assert built.cost.params is params["drafter"]  # c times the drafter without its module
  # A finished run trains nothing; a steered checkpoint seeds another run (module alone).
  finished = config.train.copy_and_resolve_references()
  finished.steering.update(config.steered_runs["steered"])
  train_steering.run(finished, steered_dir,
                     step_hook=lambda s: pytest.fail(f"step {s} dispatched"))
  # Resuming it with another module is refused by name, before any array is read.
  other = finished.copy_and_resolve_references()
  other.steering.mode = "simple"
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"other `steering` settings .*mode: saved 'merged', this run 'simple'"):
    train_steering.run(other, steered_dir)
  frozen = config.train.copy_and_resolve_references()
  frozen.steering.freeze_drafter = True
  frozen.drafter.checkpoint = steered_dir
  frozen.train.update(num_steps=2, checkpoint_every=2)
  train_steering.run(frozen, str(tmp_path / "frozen"))
  _, again, _ = checkpoints.load_model(str(tmp_path / "frozen"))
  for a, b in zip(jax.tree.leaves(params["drafter"]), jax.tree.leaves(again["drafter"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(params["steering"]["w_g"]),
                            np.asarray(again["steering"]["w_g"]))


@pytest.mark.parametrize("overrides, message", [
    ({"data.source": "onpolicy"}, r"data.source='onpolicy': train_steering trains on fixed"),
    ({"steering.mode": "add"}, r"steering.mode='add' is not known"),
    ({"steering.max_offset": 0}, r"steering.max_offset=0 must be >= 1"),
])
def test_bad_steering_config_is_named_before_anything_loads(tmp_path, overrides, message):
  from configs import train_steering as steering_config  # noqa: PLC0415
  from spec_jax.programs import train_steering  # noqa: PLC0415
  config = testing.with_overrides(steering_config.get_config("smoke"), overrides)
  with pytest.raises(ValueError, match=message):
    train_steering.run(config, str(tmp_path))


def test_a_feature_drafter_is_refused_before_anything_loads(tmp_path, monkeypatch):
  """SD² steers a plain LM drafter: a feature drafter's checkpoint (the main quickstart's kind)
  is named from its meta alone, before the verifier or the drafter loads (it crashed in the
  drafter's forward, which got no features)."""
  import dataclasses  # noqa: PLC0415
  from configs import train_steering as steering_config  # noqa: PLC0415
  from spec_jax import loading  # noqa: PLC0415
  from spec_jax.data.tokenizer import ByteTokenizer  # noqa: PLC0415
  from spec_jax.programs import train_steering  # noqa: PLC0415
  from spec_jax.training import checkpoints  # noqa: PLC0415
  cfg, params = testing.tiny_model(seed=0)
  manager = checkpoints.make_manager(str(tmp_path / "features"), async_save=False)
  state = type("State", (), dict(step=0, params=params, opt_state={}))()
  checkpoints.save(manager, 0, state, checkpoints.make_meta(
      dataclasses.replace(cfg, feature_width=cfg.d_model), ByteTokenizer()))
  manager.close()
  monkeypatch.setattr(loading, "load_model", testing.refuse)
  config = steering_config.get_config("smoke")
  config.drafter.checkpoint = str(tmp_path / "features")
  with pytest.raises(ValueError, match=r"is a feature drafter .* Fix: --config.drafter.checkpoint="):
    train_steering.run(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")
