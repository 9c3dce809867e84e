"""Drafters built from a verifier: a subset of its layers, and reduced output vocabularies.

A model section's `size` names a variant and, after colons, what to keep of the loaded model:

  smollm2-135m:layers=0,1,2     blocks 0, 1 and 2 (also `0+1+2`), in that order
  smollm2-135m:first=4          blocks 0..3
  smollm2-135m:every=10         blocks 0, 10, 20
  drafter-s:vocab=8192          an output layer over the 8192 most frequent tokens only
  smollm2-135m:layers=29:features=1
                                a feature drafter (EAGLE, Li et al. 2024): block 29 reading
                                the verifier's final residual beside each token
  smollm2-135m:layers=29:features=2+15+27
                                a multi-layer feature drafter (EAGLE-3, Li et al. 2025): the
                                verifier's residual at depths 2, 15 and 27 (low, middle, high:
                                EAGLE-3's 2, L/2, L − 3; d = the input of verifier block d)
                                through one fc layer

A layer subset keeps the embedding, the final norm and the output head: with every layer it is
the verifier itself (logits bit for bit). `distill` then closes the gap the missing layers leave.

A reduced vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary) keeps the output
rows of the N most frequent tokens of the program's training data (`top_ids`), sets
`cfg.head_ids` and unties the embedding: the drafter reads any token and drafts only those N, so
its output layer costs N/V of the full one. Its logits are -inf elsewhere (`decoder.
expand_logits`): q is exactly 0 outside, every acceptance rule stays exact, and the verifier's
correction and bonus tokens can still be any token. Training sees the reduced logits
(`make_apply(..., reduced_logits=True)`) against targets mapped into the reduced set
(`map_batch`: tokens outside weigh 0) or the teacher's law restricted to it (`restrict`), which
is the law the drafter can best match: for q supported on the set, Σ min(p, q) is largest at
q = p restricted and renormalised.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models import decoder, llama

OPTIONS = ("layers", "first", "every", "vocab", "features", "fused", "unrolled",
           "decode_unrolled", "out_major", "pallas", "attn_kernel")
FINAL = -1  # the hidden-layer key of the final pre-norm residual (models/decoder.py)


@dataclasses.dataclass(frozen=True)
class Size:
  """A parsed `size` string: the variant and what to keep of the model (None: everything)."""
  variant: str
  layers: tuple[int, ...] | None = None
  first: int | None = None
  every: int | None = None
  vocab: int | None = None
  features: int | None = None  # 1: a feature drafter (either kind), 0 / None: an ordinary model
  feature_layers: tuple[int, ...] = ()  # a multi-layer one's verifier depths; (): final residual
  fused: int | None = None  # 1: q/k/v and gate/up as one product each (`LlamaConfig.fused`)
  unrolled: int | None = None  # 1: layers unrolled, per-layer params (`LlamaConfig.unrolled`)
  decode_unrolled: int | None = None  # 1: cached calls, scan written out (`decode_unrolled`)
  out_major: int | None = None  # 1: "o" and "down" weights stored [out, in] (`out_major`)
  pallas: int | None = None  # 1: decoding layers as hand-written GPU kernels (`LlamaConfig.pallas`)
  attn_kernel: int | None = None  # 1: decoding attention as one kernel (`LlamaConfig.attn_kernel`)

  @property
  def selects_layers(self) -> bool:
    return self.layers is not None or self.first is not None or self.every is not None


def _ints(value: str) -> tuple[int, ...]:
  return tuple(int(x) for x in value.replace("+", ",").split(",") if x.strip())


def parse_size(size: str, field: str = "model.size") -> Size:
  """`variant[:layers=i,j,..][:first=k][:every=m][:vocab=N][:features=1 | :features=a+b+c]
  [:fused=1][:unrolled=1 | :decode_unrolled=1][:out_major=1][:pallas=1 | :attn_kernel=1]` →
  Size; ValueError
  naming `field`."""
  variant, *options = str(size).split(":")
  kwargs = {}
  for option in options:
    key, eq, value = option.partition("=")
    key = key.strip()
    if key not in OPTIONS or not eq:
      raise ValueError(f"{field}={size!r}: unknown option {option!r}. Options: layers=0,1,2 (or "
                       "0+1+2), first=K, every=M, vocab=N, features=1 (or features=2+15+27), "
                       "fused=1, unrolled=1, decode_unrolled=1, out_major=1, pallas=1, "
                       "attn_kernel=1, e.g. "
                       "'smollm2-135m:layers=0,14,29'.")
    try:
      if key == "layers":
        kwargs[key] = _ints(value)
      elif key == "features" and ("+" in value or "," in value):
        kwargs.update(features=1, feature_layers=_ints(value))
      else:
        kwargs[key] = int(value)
    except ValueError:
      raise ValueError(f"{field}={size!r}: {key} takes integers, got {value!r}.") from None
  out = Size(variant, **kwargs)
  if sum(x is not None for x in (out.layers, out.first, out.every)) > 1:
    raise ValueError(f"{field}={size!r}: choose one of layers=, first=, every=.")
  if out.layers is not None and not out.layers:
    raise ValueError(f"{field}={size!r}: layers= lists no layer.")
  for key in ("first", "every", "vocab"):
    if getattr(out, key) is not None and getattr(out, key) < 1:
      raise ValueError(f"{field}={size!r}: {key} must be >= 1.")
  if out.fused not in (None, 0, 1):
    raise ValueError(f"{field}={size!r}: fused=1 computes q/k/v and gate/up as one weight "
                     "product each, fused=0 (the default) as separate ones.")
  if out.unrolled not in (None, 0, 1):
    raise ValueError(f"{field}={size!r}: unrolled=1 writes the layers out with their own "
                     "params, unrolled=0 (the default) scans them.")
  if out.decode_unrolled not in (None, 0, 1) or (out.decode_unrolled and out.unrolled):
    raise ValueError(f"{field}={size!r}: decode_unrolled=1 writes out the decoding calls' layer "
                     "scan over the stacked params; unrolled=1 already has no scan: keep one "
                     "of them (decode_unrolled=0 is the default).")
  if out.out_major not in (None, 0, 1):
    raise ValueError(f"{field}={size!r}: out_major=1 stores the o and down weights output axis "
                     "first, out_major=0 (the default) input axes first.")
  if out.pallas not in (None, 0, 1) or (out.pallas and (not out.fused or out.unrolled
                                                         or out.out_major)):
    raise ValueError(f"{field}={size!r}: pallas=1 runs the decoding calls' layers as "
                     "hand-written GPU kernels over the fused, scanned layout: write "
                     "':fused=1:pallas=1' (without unrolled=1 or out_major=1); pallas=0 is the "
                     "default.")
  if out.attn_kernel not in (None, 0, 1) or (out.attn_kernel and out.pallas):
    raise ValueError(f"{field}={size!r}: attn_kernel=1 runs the decoding calls' attention as "
                     "one hand-written GPU kernel in XLA's layers; pallas=1 already runs the "
                     "whole layers so: keep one of them (attn_kernel=0 is the default).")
  if out.features not in (None, 0, 1):
    raise ValueError(f"{field}={size!r}: features=1 makes a feature drafter (reading the "
                     "verifier's final residual), features=0 an ordinary one, features=2+15+27 "
                     "one reading those verifier depths (EAGLE-3).")
  depths = out.feature_layers
  if "feature_layers" in kwargs and (len(depths) < 2 or min(depths) < 0
                                     or len(set(depths)) < len(depths)):
    raise ValueError(f"{field}={size!r}: features= lists two or more distinct verifier depths "
                     ">= 0 (d = the input of verifier block d, d = its layer count the final "
                     "residual), e.g. features=2+15+27 for a 30-layer verifier; features=1 "
                     "reads the final residual alone.")
  return out


def layer_subset(size: Size, n_layers: int, field: str = "model.size") -> tuple[int, ...]:
  """The block indices `size` keeps of a model with n_layers blocks; ValueError naming `field`
  for a block the model lacks (or a repeated one)."""
  if size.layers is not None:
    layers = size.layers
  elif size.first is not None:
    layers = tuple(range(size.first))
  elif size.every is not None:
    layers = tuple(range(0, n_layers, size.every))
  else:
    return tuple(range(n_layers))
  bad = [i for i in layers if not 0 <= i < n_layers]
  if bad:
    raise ValueError(f"{field} keeps layers {bad} but the model has {n_layers} layers "
                     f"(0..{n_layers - 1}). Fix: choose layers inside 0..{n_layers - 1}.")
  if len(set(layers)) != len(layers):
    raise ValueError(f"{field} lists a layer twice: {list(layers)}.")
  return tuple(layers)


def select_layers(cfg: llama.LlamaConfig, params, layers, field: str = "model.size"):
  """(cfg, params) of the model keeping only `layers` (block indices, in the order given) with
  its embedding, final norm and output head, in the params' own layout (stacked or unrolled).
  Sliding windows and per-layer RoPE follow their layers."""
  layers = layer_subset(Size("", layers=tuple(layers)), cfg.n_layers, field)
  idx = np.asarray(layers)
  windows = tuple(cfg.layer_windows[i] for i in layers) if cfg.layer_windows else ()
  new_cfg = dataclasses.replace(cfg, n_layers=len(layers), layer_windows=windows)
  if cfg.unrolled:  # one tree per layer, "layers_<i>" (`layers.unstack_layers`)
    new_params = {k: v for k, v in params.items() if not k.startswith("layers_")}
    new_params.update({f"layers_{j}": params[f"layers_{i}"] for j, i in enumerate(layers)})
    return new_cfg, new_params
  new_params = dict(params)
  new_params["layers"] = jax.tree.map(lambda x: x[idx], params["layers"])
  return new_cfg, new_params


def feature_drafter(cfg: llama.LlamaConfig, params, layers=()):
  """(cfg, params) of a feature drafter (EAGLE) made of a model's blocks: it reads, beside each
  token, the verifier's final residual one position back, through fc([f / rms; e / rms])
  initialised to the sum [I; I]. The verifier must be as wide as the model the blocks came from
  (`check_feature_width`).

  layers (EAGLE-3, `Size.feature_layers`): the verifier's residual at these depths, each at unit
  RMS, concatenated and mapped to f by one more fc, `feature_fc` [n·D, D], initialised to the
  identity on the deepest depth's slot and zeros elsewhere (`llama.feature_fc_kernel`): the
  drafter starts as a final-residual drafter reading that depth in place of the final residual
  (exactly today's drafter, to float rounding, when the deepest depth is the final one)."""
  if cfg.feature_width:
    return cfg, params
  new_cfg = dataclasses.replace(cfg, feature_width=cfg.d_model, feature_layers=tuple(layers))
  if params is None:
    return new_cfg, None
  dtype = np.asarray(params["embed"]["embedding"]).dtype
  eye = np.eye(cfg.d_model, dtype=np.float32)
  kernel = np.concatenate([eye, eye], axis=0).astype(dtype)
  params = {**params, "fc": {"kernel": kernel}}
  if layers:
    params["feature_fc"] = {"kernel": llama.feature_fc_kernel(new_cfg).astype(dtype)}
  return new_cfg, params


def check_feature_width(verifier_cfg, drafter_cfg, field: str = "drafter.checkpoint") -> None:
  """ValueError naming `field` when a feature drafter reads features of another width than the
  verifier's residual stream, or (multi-layer) depths the verifier lacks: a drafter built for
  another verifier."""
  width = drafter_cfg.feature_width
  if width and width != verifier_cfg.d_model:
    raise ValueError(f"{field} is a feature drafter reading the verifier's residual stream of "
                     f"width {width}, but the verifier's is {verifier_cfg.d_model}. Fix: use a "
                     "feature drafter built from this verifier's blocks (size "
                     "'<verifier>:layers=...:features=1').")
  n = verifier_cfg.n_layers
  if any(d > n for d in getattr(drafter_cfg, "feature_layers", ())):
    raise ValueError(f"{field} is a feature drafter reading the verifier's residual at depths "
                     f"{list(drafter_cfg.feature_layers)}, but the verifier has {n} layers "
                     f"(depths 0..{n}). Fix: build it from this verifier with depths in "
                     f"0..{n} (size '<verifier>:layers=...:features=a+b+c').")


def count_tokens(tokens, vocab_size: int) -> np.ndarray:
  """int64[V]: how often each token id occurs in `tokens` (any shape of ids)."""
  return np.bincount(np.asarray(tokens, np.int64).ravel(), minlength=vocab_size)[:vocab_size]


def top_ids(counts: np.ndarray, n: int, field: str = "model.size") -> tuple[int, ...]:
  """The n most frequent token ids (ties: the lower id first), ascending; ValueError naming
  `field` when n exceeds the vocabulary."""
  counts = np.asarray(counts)
  if not 1 <= n <= counts.size:
    raise ValueError(f"{field} asks for a reduced vocabulary of {n} tokens but the tokenizer "
                     f"has {counts.size}. Fix: vocab=N with N <= {counts.size}.")
  order = np.argsort(-counts, kind="stable")[:n]
  return tuple(int(i) for i in np.sort(order))


def reduce_vocab(cfg: llama.LlamaConfig, params, ids, field: str = "model.size"):
  """(cfg, params) whose output layer keeps only the rows of token `ids` (copied from the
  model's own output projection: the embedding when tied). The input embedding stays whole."""
  ids = tuple(int(i) for i in ids)
  llama.check_head_ids(ids, cfg.vocab_size, field)
  new_cfg = dataclasses.replace(cfg, tie_embeddings=False, head_ids=ids)
  if params is None:
    return new_cfg, None
  if cfg.tie_embeddings:
    kernel = np.asarray(params["embed"]["embedding"])[np.asarray(ids)].T
  else:
    old = np.asarray(params["lm_head"]["kernel"])
    column = {t: j for j, t in enumerate(cfg.head_ids or range(cfg.vocab_size))}
    missing = [t for t in ids if t not in column]
    if missing:
      raise ValueError(f"{field}: the model's reduced vocabulary lacks tokens {missing[:5]}; "
                       "a smaller vocabulary must be a subset of it.")
    kernel = old[:, [column[t] for t in ids]]
  return new_cfg, {**params, "lm_head": {"kernel": kernel}}


def target_index(cfg: llama.LlamaConfig) -> np.ndarray:
  """int32[V]: each token's row in the reduced output layer, -1 outside it."""
  index = np.full((cfg.vocab_size,), -1, np.int32)
  index[np.asarray(cfg.head_ids)] = np.arange(len(cfg.head_ids), dtype=np.int32)
  return index


def map_batch(cfg: llama.LlamaConfig, batch: Mapping[str, np.ndarray]) -> dict:
  """A training batch for the reduced logits: targets as rows of the reduced output layer, and
  weight 0 for targets outside it (nothing the drafter could draft). Unchanged without one."""
  if not cfg.head_ids:
    return dict(batch)
  index = target_index(cfg)[np.asarray(batch["targets"])]
  return {**batch, "targets": np.maximum(index, 0),
          "weights": np.where(index >= 0, batch["weights"], 0).astype(np.float32)}


def restrict(cfg: llama.LlamaConfig, teacher_cfg: llama.LlamaConfig, layers=()):
  """The teacher's forward (hidden `layers`) with its logits only at the student's reduced
  vocabulary (`cfg.head_ids`), so a divergence compares the two laws on the same rows: the
  teacher's law restricted to the set and renormalised. Its output layer is applied to those
  rows alone (the full logits are never used, so the compiled step never computes them).
  Unchanged without one. Takes `logit_index` as `llama.make_apply`'s forward does."""
  layers = tuple(layers)
  if not cfg.head_ids:
    return llama.make_apply(teacher_cfg, layers)
  if teacher_cfg.head_ids:  # a reduced teacher: gather its spread logits
    ids = np.asarray(cfg.head_ids, np.int32)
    teacher_apply = llama.make_apply(teacher_cfg, layers)

    def gathered(*args, **kwargs):
      logits, hidden, cache = teacher_apply(*args, **kwargs)
      return logits[..., ids], hidden, cache

    return gathered
  teacher_apply = llama.make_apply(teacher_cfg, _with_final(layers))
  head = teacher_parts(cfg, teacher_cfg, layers)[1]

  def apply(params, *args, logit_index=None, **kwargs):
    _, hidden, cache = teacher_apply(params, *args, **kwargs)
    return (*head(params, hidden, logit_index), cache)

  return apply


def _with_final(layers: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(dict.fromkeys((*layers, FINAL)))


def teacher_parts(cfg: llama.LlamaConfig, teacher_cfg: llama.LlamaConfig, layers=()
                  ) -> tuple[Callable, Callable] | None:
  """`restrict`'s teacher in two parts, so that its pass over a batch can be computed once and
  reused (training/distill.py's TeacherCache):
    body(params, tokens[B,T], positions[B,T]) -> hidden {layer: [B,T,D]} at `layers` and FINAL
      (the final pre-norm residual): every block, no output layer;
    head(params, hidden, logit_index=None) -> (logits [B,T,V'], hidden at `layers`): the final
      norm and the output layer, at the student's rows when it has a reduced vocabulary, and at
      the positions logit_index int32[B,K] alone when given (logits [B,K,V']).
  head(params, body(params, tokens, positions)) is restrict's forward. None for a teacher with a
  reduced vocabulary of its own (its logits are then not the output layer of FINAL here)."""
  if teacher_cfg.head_ids:
    return None
  layers = tuple(layers)
  forward = llama.make_apply(teacher_cfg, _with_final(layers))
  ids = np.asarray(cfg.head_ids, np.int32) if cfg.head_ids else None

  def body(params, tokens, positions):
    return forward(params, tokens, positions)[1]  # the unused logits are compiled away

  def head(params, hidden, logit_index=None):
    rows = params
    if ids is not None:
      rows = {"final_norm": params["final_norm"]}
      if teacher_cfg.tie_embeddings:
        rows["embed"] = {"embedding": params["embed"]["embedding"][ids]}
      else:
        rows["lm_head"] = {"kernel": params["lm_head"]["kernel"][:, ids]}
    final = hidden[FINAL]
    if logit_index is not None:
      final = jnp.take_along_axis(final, logit_index[..., None], axis=1)
    logits = decoder.output_logits(teacher_cfg, rows, final)
    return logits, {k: v for k, v in hidden.items() if k in layers}

  return body, head
