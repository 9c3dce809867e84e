"""SD² steering (Berdoz, Rheinboldt, Wattenhofer, "Steering Pretrained Drafters during
Speculative Decoding", AAAI 2026): a vector computed from the verifier's hidden states after each
verification, injected into every layer of a pretrained drafter for the next round.

Shape letters (repo legend): B batch, T tokens, D the verifier's model width, L the drafter's
layers, F the drafter's feed-forward width, E the drafter's model width, X the injected width
(F for "merged", E for "simple").

  g = W_hml · [h_low; h_mid; h_high] + b            the verifier's residual stream entering three
                                                     layers (`verifier_layers`), f32[.., D]
  δ = reshape(W_g · LayerNorm(g), [L, X])            one delta per drafter layer
  merged:  MLP_ℓ(u) = W_down(SiLU(W_gate u) ⊙ (W_up u + δ_ℓ))   (the paper's choice)
  simple:  block_ℓ(u) = u + attn + MLP + δ_ℓ        (a residual-stream add, the ablation)
W_hml starts as [I I I] and b as 0, so g = h_low + h_mid + h_high; W_g starts at zero, so a fresh
module leaves the drafter exactly as pretrained (δ = 0). The deltas enter the model through
`llama.make_apply(...)(..., steer=deltas(...))`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from spec_jax.models import llama
from spec_jax.models.llama import check_layers

MODES = ("merged", "simple")


@dataclasses.dataclass(frozen=True)
class SteeringConfig:
  """Static description of a steering module (saved in a steered checkpoint's meta).

  verifier_layers  residual depths of the verifier read (l = input of block l), low to high
  d_verifier       D, the verifier's width
  drafter_layers   L, the drafter's layer count (one delta each)
  width            X: the drafter's d_ff (merged) or d_model (simple)
  mode             "merged" (into the SwiGLU up projection) or "simple" (residual add)
  """
  verifier_layers: tuple[int, ...]
  d_verifier: int
  drafter_layers: int
  width: int
  mode: str = "merged"
  norm_eps: float = 1e-5

  def __post_init__(self):
    object.__setattr__(self, "verifier_layers", tuple(int(x) for x in self.verifier_layers))
    if self.mode not in MODES:
      raise ValueError(f"steering.mode={self.mode!r} is not known; choose one of {list(MODES)} "
                       "('merged': into the drafter's SwiGLU MLP, 'simple': residual add).")
    if not self.verifier_layers:
      raise ValueError("steering.verifier_layers is empty: name the verifier depths to read, "
                       "e.g. (3, 15, 27) for SmolLM2-135M's 30 layers.")

  @property
  def injection(self) -> str:
    """The `steer` key the deltas go under (llama.Block)."""
    return "up" if self.mode == "merged" else "residual"


def make_config(verifier_cfg: llama.LlamaConfig, drafter_cfg, layers: Sequence[int],
                mode: str = "merged") -> SteeringConfig:
  """The steering module joining these two models; errors name the config field and the fix."""
  n = verifier_cfg.n_layers
  layers = check_layers(layers, n, "steering.verifier_layers")
  if not hasattr(drafter_cfg, "d_ff"):
    raise ValueError(
        f"The drafter ({type(drafter_cfg).__name__}) has no SwiGLU MLP to steer: the merged "
        "injection adds δ to the up projection of a Llama-family MLP. Fix: use a Llama-family "
        "drafter (drafter.size / drafter.checkpoint) or steering.mode='simple'.")
  width = drafter_cfg.d_ff if mode == "merged" else drafter_cfg.d_model
  return SteeringConfig(tuple(n if x == -1 else x for x in layers), verifier_cfg.d_model,
                        drafter_cfg.n_layers, width, mode)


def default_layers(num_layers: int) -> tuple[int, int, int]:
  """Low, middle and high depths as in SD² (SmolLM2's 30 layers: 3, 15, 27)."""
  return (max(num_layers // 10, 0), num_layers // 2, max(num_layers - num_layers // 10, 0))


def init_params(cfg: SteeringConfig) -> dict:
  """{"hml": {"w": f32[3, D, D] = I, "b": f32[D] = 0}, "norm": {"scale", "bias"}: LayerNorm,
  "w_g": f32[D, L·X] = 0}. W_hml is stored per input (w[i] maps h_i), i.e. [I I I] blocked."""
  d, k = cfg.d_verifier, len(cfg.verifier_layers)
  return {"hml": {"w": jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (k, d, d)),
                  "b": jnp.zeros((d,), jnp.float32)},
          "norm": {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)},
          "w_g": jnp.zeros((d, cfg.drafter_layers * cfg.width), jnp.float32)}


def param_shapes(cfg: SteeringConfig):
  return jax.eval_shape(lambda: init_params(cfg))


def guidance(params, features: Sequence[jax.Array]) -> jax.Array:
  """g f32[.., D] = Σ_i h_i · W_hml[i] + b from the verifier residuals h_i f32[.., D] (one per
  `verifier_layers` entry, in order)."""
  w = params["hml"]["w"]
  g = params["hml"]["b"]
  for i, h in enumerate(features):
    g = g + jnp.einsum("...D,DE->...E", h.astype(jnp.float32), w[i])
  return g


def _layer_norm(params, x: jax.Array, eps: float) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * params["scale"] + params["bias"]


def deltas(cfg: SteeringConfig, params, g: jax.Array) -> dict:
  """g f32[B, (T,) D] → the drafter's `steer` argument {injection: f32[L, B, (T,) X]}."""
  flat = jnp.einsum("...D,DY->...Y", _layer_norm(params["norm"], g, cfg.norm_eps), params["w_g"])
  per_layer = flat.reshape(*flat.shape[:-1], cfg.drafter_layers, cfg.width)
  return {cfg.injection: jnp.moveaxis(per_layer, -2, 0)}


def steer_from_hidden(cfg: SteeringConfig, params, hidden: dict) -> dict:
  """The verifier's hidden states {layer: f32[B, (T,) D]} (as the Verifier protocol returns
  them, with cfg.verifier_layers among the keys) → the drafter's `steer`."""
  return deltas(cfg, params, guidance(params, [hidden[l] for l in cfg.verifier_layers]))


def check_params(cfg: SteeringConfig, params, source: str) -> None:
  """ValueError naming `source` when saved steering params do not fit the models."""
  want = jax.tree.map(lambda s: tuple(s.shape), param_shapes(cfg))
  got = jax.tree.map(lambda a: tuple(a.shape), params)
  if want != got:
    raise ValueError(
        f"{source}: the steering module's shapes {got} do not fit the verifier and drafter "
        f"(expected {want}: D = {cfg.d_verifier}, L = {cfg.drafter_layers}, width = "
        f"{cfg.width}). Fix: load the verifier and drafter the module was trained with.")


def check_verifier(cfg: SteeringConfig, verifier_cfg, source: str) -> None:
  """ValueError naming `source` when a saved module reads a verifier other than this one."""
  check_layers(cfg.verifier_layers, verifier_cfg.n_layers, f"{source}: steering.verifier_layers")
  if cfg.d_verifier != verifier_cfg.d_model:
    raise ValueError(
        f"{source}: the steering module reads a verifier of width {cfg.d_verifier} but this "
        f"verifier has d_model = {verifier_cfg.d_model}. Fix: evaluate with the verifier the "
        "module was trained with (verifier.checkpoint), or train a module for this one "
        "(program train_steering).")
