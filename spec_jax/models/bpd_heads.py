"""Blockwise parallel decoding heads (Stern et al. 2018; Medusa, Cai et al. 2024) on a verifier.

Shape letters (repo legend): B batch, T tokens, D the verifier's width, F a head's hidden width,
V vocabulary, A = h heads.

Head k (k = 1..h) reads the verifier's final pre-norm residual x at a position t (the stream whose
output, through the verifier's own head, is the token at t + 1) and predicts the token at
t + 1 + k:
    u_k = x + W2_k · SiLU(W1_k · x + b1_k)                    (a residual feed-forward block)
    logits_k = output(u_k)                                     (the verifier's final norm and
                                                                output projection, shared)
W2 starts at zero, so a fresh head is exactly the verifier's next-token prediction. With
`own_projection` each head has its own [D, V] projection (initialised from the verifier's) and
the final norm stays shared. The h heads are one parallel map (`jax.vmap`) over parameters stacked
on a leading head axis A; decoding on a mesh splits that axis over 'tensor'
(`parallel.HEAD_ROLES`), so each device evaluates its own heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models import decoder, llama


@dataclasses.dataclass(frozen=True)
class BPDConfig:
  """h = num_heads heads of width `hidden` (0 = the verifier's d_model) on a verifier of width
  d_model and vocabulary vocab_size."""
  num_heads: int
  d_model: int
  vocab_size: int
  hidden: int = 0
  own_projection: bool = False
  # The verifier's logits on a fixed probe (`verifier_probe`), recorded by train_bpd: heads on a
  # verifier of the same shape but other weights are refused (`check_verifier`). () = unknown.
  verifier_probe: tuple = ()

  def __post_init__(self):
    object.__setattr__(self, "verifier_probe", tuple(float(x) for x in self.verifier_probe))
    if self.num_heads < 1:
      raise ValueError(f"bpd.num_heads={self.num_heads}: give at least one head (h >= 1).")
    if self.hidden < 0:
      raise ValueError(f"bpd.hidden={self.hidden} must be >= 0 (0 = the verifier's width).")
    if self.d_model < 1 or self.vocab_size < 1:
      raise ValueError(f"BPDConfig needs d_model, vocab_size >= 1, got {self.d_model}, "
                       f"{self.vocab_size}.")

  @property
  def width(self) -> int:
    return self.hidden or self.d_model

  @classmethod
  def for_verifier(cls, v_cfg, num_heads: int, hidden: int = 0, own_projection: bool = False):
    return cls(num_heads, v_cfg.d_model, v_cfg.vocab_size, hidden, own_projection)


def verifier_output(v_cfg, v_params, ids=None) -> dict:
  """The verifier parameters the heads share: its final norm and output projection (the
  embedding when tied). A view of `v_params`, not a copy; with `ids` (int[N], training over a
  token subset: `training/bpd.py`) the projection keeps only those tokens' rows, so
  `decoder.output_logits` gives logits [..., N] in the order of `ids`."""
  out = {"final_norm": v_params["final_norm"]}
  if v_cfg.tie_embeddings:
    table = v_params["embed"]["embedding"]
    out["embed"] = {"embedding": table if ids is None else jnp.take(table, ids, axis=0)}
  else:
    kernel = v_params["lm_head"]["kernel"]
    out["lm_head"] = {"kernel": kernel if ids is None else jnp.take(kernel, ids, axis=1)}
  return out


def init_params(cfg: BPDConfig, rng: jax.Array, v_cfg=None, v_params=None) -> dict:
  """{"w1" f32[A, D, F] ~ N(0, 0.02), "b1" f32[A, F] = 0, "w2" f32[A, F, D] = 0} and, with
  own_projection, "out" f32[A, D, V] = the verifier's projection (v_cfg, v_params needed)."""
  a, d, f = cfg.num_heads, cfg.d_model, cfg.width
  params = {"w1": 0.02 * jax.random.normal(rng, (a, d, f), jnp.float32),
            "b1": jnp.zeros((a, f), jnp.float32), "w2": jnp.zeros((a, f, d), jnp.float32)}
  if cfg.own_projection:
    if v_params is None:
      raise ValueError("bpd.own_projection=True initialises each head's projection from the "
                       "verifier's: pass v_cfg and v_params.")
    w = (v_params["embed"]["embedding"].T if v_cfg.tie_embeddings
         else v_params["lm_head"]["kernel"])
    params["out"] = jnp.broadcast_to(w.astype(jnp.float32), (a, *w.shape))
  return params


def check(cfg: BPDConfig, params, v_cfg, field: str = "drafter") -> None:
  """ValueError naming `field` when heads do not fit the verifier (width, vocabulary, count)."""
  if (cfg.d_model, cfg.vocab_size) != (v_cfg.d_model, v_cfg.vocab_size):
    raise ValueError(
        f"{field}: BPD heads for a verifier of width {cfg.d_model} and {cfg.vocab_size} tokens "
        f"cannot run on this verifier (width {v_cfg.d_model}, {v_cfg.vocab_size} tokens). Train "
        "heads for this verifier (train_bpd) or use the verifier they were trained on.")
  shapes = {k: tuple(v.shape) for k, v in params.items()}
  want = {"w1": (cfg.num_heads, cfg.d_model, cfg.width), "b1": (cfg.num_heads, cfg.width),
          "w2": (cfg.num_heads, cfg.width, cfg.d_model)}
  if cfg.own_projection:
    want["out"] = (cfg.num_heads, cfg.d_model, cfg.vocab_size)
  if shapes != want:
    raise ValueError(f"{field}: BPD head parameters have shapes {shapes}, but the config "
                     f"{cfg} needs {want}.")


PROBE_TOKENS = 8  # a fixed probe sequence 1..8 (mod V)
PROBE_LOGITS = 16  # logits read at spread-out ids of the last position
PROBE_TOLERANCE = 0.05  # relative L2 distance: bf16 vs f32 of one verifier stays far below


def verifier_probe(v_cfg, v_params) -> tuple[float, ...]:
  """A verifier's fingerprint that survives a change of dtype: its last-position logits on the
  probe sequence at PROBE_LOGITS evenly spread ids (float32)."""
  v = v_cfg.vocab_size
  tokens = jnp.asarray([[(i + 1) % v for i in range(PROBE_TOKENS)]], jnp.int32)
  logits, _, _ = jax.jit(llama.make_apply(v_cfg))(v_params, tokens,
                                                  jnp.arange(PROBE_TOKENS)[None])
  ids = np.linspace(0, v - 1, PROBE_LOGITS).astype(np.int32)
  return tuple(float(x) for x in np.asarray(logits[0, -1], np.float32)[ids])


def check_verifier(cfg: BPDConfig, v_cfg, v_params, field: str = "drafter.checkpoint") -> None:
  """ValueError naming `field` when the heads were trained on another verifier of the same shape
  (its probe logits differ by more than PROBE_TOLERANCE in relative L2 distance)."""
  if not cfg.verifier_probe:
    return
  want = np.asarray(cfg.verifier_probe)
  got = np.asarray(verifier_probe(v_cfg, v_params))
  dist = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-6))
  if not dist <= PROBE_TOLERANCE:
    raise ValueError(
        f"{field}: these BPD heads were trained on another verifier (same shape, other weights: "
        f"its logits on a fixed probe differ by {dist:.0%}, more than {PROBE_TOLERANCE:.0%}). "
        "Fix: point verifier.checkpoint at the model they were trained on, or train heads for "
        "this verifier with train_bpd.")


def head_states(params, x: jax.Array) -> jax.Array:
  """u f32[..., A, D]: every head's residual block applied to x f32[..., D], one vmap over A."""
  def one(w1, b1, w2):
    return x + jax.nn.silu(x @ w1 + b1) @ w2
  return jnp.moveaxis(jax.vmap(one)(params["w1"], params["b1"], params["w2"]), 0, -2)


def head_logits(cfg: BPDConfig, params, v_cfg, v_out, x: jax.Array) -> jax.Array:
  """logits f32[..., A, V] of the h heads at the verifier residual x f32[..., D] (float32)."""
  u = head_states(params, x.astype(jnp.float32))
  if not cfg.own_projection:
    return decoder.output_logits(v_cfg, v_out, u)
  y = decoder.final_norm(v_cfg, v_out, u).astype(jnp.float32)
  return jnp.einsum("...AD,ADV->...AV", y, params["out"])


def one_head_logits(cfg: BPDConfig, params, v_cfg, v_out, u: jax.Array, j: int,
                    ids=None) -> jax.Array:
  """logits f32[..., V] of head j (0-based) from its state u f32[..., D] (`head_states`'s
  [..., j, :]); with `ids` (int[N]) only those tokens' logits [..., N], v_out then being
  `verifier_output(..., ids)`. Training projects one head at a time: h [.., V] slabs at once are
  h times the memory traffic, which costs more than the matmuls on a CPU."""
  if not cfg.own_projection:
    return decoder.output_logits(v_cfg, v_out, u)
  y = decoder.final_norm(v_cfg, v_out, u).astype(jnp.float32)
  return y @ (params["out"][j] if ids is None else jnp.take(params["out"][j], ids, axis=1))
