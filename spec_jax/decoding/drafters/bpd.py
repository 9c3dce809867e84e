"""Blockwise parallel decoding as a drafter: BPD heads (`models/bpd_heads.py`) on the verifier's
final residual, fed back through `commit` every round, so drafting costs no drafter model and no
extra verifier call.

Shape letters (repo legend): B batch, P padded prompt length, A = h heads, D the verifier's width,
V vocabulary, M = h + 1 proposal nodes.

State: x f32[B, D], the verifier's final pre-norm residual at the deepest accepted node of the
last verify call: the position whose output produced the round's correction/bonus token y (the
last committed token). At the prompt, the residual at position L − 2, whose output is the last
prompt token. `propose` drafts x_k (k = 1..γ) from head k's law q_k, the token k positions after
y: argmax when greedy, else a draw from q_k. The drafts are drawn independently given x, and q_k is
exactly the law x_k came from, so every exact rule stays lossless (a head's draft ignores the
earlier drafts, which rejection sampling allows); greedy output equals the verifier's. With a tree
spec the heads' top-k lattice becomes a draft tree: the children of every node at depth d − 1
come from head d's law, drawn as the spec says (RSD-C's Gumbel-top-k without replacement, beams,
i.i.d. chains; top-k at T = 0), and the verifier checks the whole tree in one call.

Params: {"heads": the stacked head params, "out": `bpd_heads.verifier_output(v_cfg, v_params)`}
(a view of the verifier's final norm and projection, passed again so the drafter stays a pure
function of its own params).
"""

from __future__ import annotations

import dataclasses
import os

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding import methods
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding.drafters import hidden, lattice, trees
from spec_jax.decoding.protocols import Proposal
from spec_jax.models import bpd_heads, ngram


@dataclasses.dataclass(frozen=True)
class LatticeRescoring:
  """Global rescoring of the heads' top-k lattice (Kim et al. 2024): the `paths` best of the k^h
  paths under (1 − w)·log q_head + w·log p_ngram (w = `weight`, summed over positions) are
  verified together as one prefix tree (`lattice.py`). The kept set is deterministic, with no
  exact law, so only greedy decoding verifies it. params["ngram"] holds the n-gram LM
  (`models.ngram`); weight 0 ranks by the heads alone (paths = 1 then is plain BPD).
  beam: in place of the p best full paths, the tree of a beam search of width `paths` that
  keeps every level's beam (`lattice.beam_tree`; method bpd_ngram_beam), same score."""
  top_k: int = 4
  paths: int = 16
  weight: float = 0.5
  beam: bool = False

  def check(self, num_heads: int, field: str = "bpd") -> None:
    lattice.check_shape(num_heads, self.top_k, self.paths, field=field, beam=self.beam)
    if not 0.0 <= float(self.weight) <= 1.0:
      raise ValueError(f"{field}.ngram_weight={self.weight} must be in [0, 1] (0 = the heads' "
                       "ranking alone, 1 = the n-gram alone).")


class HeadsDrafter:
  """What every drafter built on BPD heads shares (`heads`: the BPDConfig, `gamma`: the draft
  depth, 0 = all h): its vocabulary, depth and the verifier layer it reads (the final one)."""
  heads: bpd_heads.BPDConfig
  gamma: int

  @property
  def vocab_size(self) -> int:
    return self.heads.vocab_size

  @property
  def depth(self) -> int:
    return self.gamma or self.heads.num_heads

  @property
  def verifier_layers(self) -> tuple[int, ...]:
    return (-1,)


@dataclasses.dataclass(frozen=True)
class BPDDrafter(HeadsDrafter):
  """Chain drafts of γ ≤ h tokens, or a tree of depth L ≤ h (any `trees.TreeSpec`: RSD-C
  top-k lattices, RSD-S beams, i.i.d. chains), from BPD heads. Implements `protocols.Drafter`."""
  heads: bpd_heads.BPDConfig
  v_cfg: object  # the verifier's model config (its final norm, projection, soft-capping)
  gamma: int = 0  # draft length: the first γ heads (0 = all h)
  tree: trees.TreeSpec | None = None  # a tree of depth L ≤ h from the heads' lattice, or a chain
  rescore: LatticeRescoring | None = None  # global n-gram rescoring of the lattice (greedy only)

  def __post_init__(self):
    if self.tree is not None and not self.tree.is_chain:
      object.__setattr__(self, "gamma", self.tree.depth)
    if not 0 <= self.gamma <= self.heads.num_heads:
      raise ValueError(f"BPD draft length γ={self.gamma} needs γ heads; these are "
                       f"{self.heads.num_heads}.")
    if self.rescore is not None:
      if self.tree is not None and not self.tree.is_chain:
        raise ValueError("BPD lattice rescoring builds its own tree of the p best paths; give "
                         "a depth (γ), not a tree shape.")
      self.rescore.check(self.depth)

  @property
  def shape(self) -> trees.TreeSpec:
    if self.rescore is not None:
      return lattice.shape(self.rescore.paths, self.depth, self.rescore.beam)
    return self.tree if self.tree is not None and not self.tree.is_chain else trees.chain(
        self.depth)

  def params(self, head_params, v_params, ngram_lm=None) -> dict:
    """The drafter's params from trained heads and the verifier they were trained on (and the
    n-gram LM that rescores the lattice, when `rescore` is set)."""
    bpd_heads.check(self.heads, head_params, self.v_cfg)
    bpd_heads.check_verifier(self.heads, self.v_cfg, v_params)
    out = {"heads": head_params, "out": bpd_heads.verifier_output(self.v_cfg, v_params)}
    if ngram_lm is not None:
      ngram.check(ngram_lm, self.heads.vocab_size, "eval.bpd.ngram")
      out["ngram"] = ngram_lm
    return out

  def init(self, params, prompt_tokens, prompt_lengths, size: int, v_hidden):
    del params, prompt_tokens, size
    return hidden.prompt_state(v_hidden[-1], prompt_lengths)

  def logits(self, params, x: jax.Array) -> jax.Array:
    """f32[B, γ, V]: the first γ heads' logits at the residual x f32[B, D]."""
    heads = params["heads"]
    if self.depth < self.heads.num_heads:
      heads = jax.tree.map(lambda a: a[:self.depth], heads)
    return bpd_heads.head_logits(self.heads, heads, self.v_cfg, params["out"], x)

  def propose(self, params, x, tokens, lengths, rng, sampling: sampling_lib.Sampling):
    logits = self.logits(params, x)                                    # [B, L, V]
    if self.rescore is not None:
      return self._rescored(params, logits, tokens, lengths, sampling), x
    if self.shape.is_chain:
      return hidden.draft_chain(tokens, lengths, logits, rng, sampling), x
    root = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
    return self._tree(logits, root, rng, sampling), x

  def _tree(self, logits, root, rng, sampling):
    """A draft tree from the heads' lattice: every node at depth d − 1 draws its children from
    head d's law (the heads do not condition on earlier drafts), with the tree's own scheme
    (`trees.expand`: Gumbel-top-k without replacement for rsd_c, i.i.d. chains, beams), so q
    is the exact law of every node's children and the tree rules stay exact."""
    spec = self.shape
    b, _, v = logits.shape
    levels, q_levels = [trees.root_level(root)], []
    for d in range(1, spec.depth + 1):
      width = 1 if d == 1 else spec.level_widths[d - 2]
      level_logits = jnp.broadcast_to(logits[:, d - 1][:, None], (b, width, v))
      q = sampling_lib.probs_from_logits(level_logits, sampling)
      q_levels.append(q)
      levels.append(trees.expand(spec, d, jax.random.fold_in(rng, d), level_logits, q,
                                 levels[-1], spec.level_offsets[d - 1], sampling))
    q_levels.append(jnp.zeros((b, spec.level_widths[-1], v), jnp.float32))
    tree = trees.assemble(spec, levels)
    return Proposal(tokens=tree.tokens, parent=tree.parent, depth=tree.depth, valid=tree.valid,
                    q=jnp.concatenate(q_levels, axis=1), chain=False, scheme=spec.scheme,
                    max_depth=spec.depth, max_candidates=spec.max_candidates)

  def _rescored(self, params, logits, tokens, lengths, sampling):
    """The p best lattice paths as one prefix tree (`LatticeRescoring`); q = None: greedy only."""
    if not sampling.greedy:
      raise ValueError(
          "BPD lattice rescoring (bpd_ngram) verifies a deterministic set of p best paths, "
          "which has no exact law: it runs at temperature 0 only. Fix: set the temperature to "
          "0, or sample with plain BPD or bpd_neural (whose draft law is exact).")
    r = self.rescore
    lm = params.get("ngram")
    if lm is None and r.weight > 0:
      raise ValueError("BPD lattice rescoring with weight > 0 needs params['ngram'] (pass the "
                       "n-gram LM to BPDDrafter.params).")
    root = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
    hist = lattice.history(tokens, lengths, lm.order - 1) if lm is not None else None
    tree = lattice.rescored_tree(logits, root, hist, lm, top_k=r.top_k, paths=r.paths,
                                 weight=float(r.weight), beam=r.beam)
    spec = self.shape
    return Proposal(tokens=tree.tokens, parent=tree.parent, depth=tree.depth, valid=tree.valid,
                    q=None, chain=False, scheme=spec.scheme, max_depth=spec.depth,
                    max_candidates=min(r.paths, r.top_k))

  def commit(self, params, x, proposal, verdict, lengths, v_hidden):
    del params, x, proposal, lengths
    return hidden.accepted_state(v_hidden[-1], verdict)


# --- methods (`decoding.methods`): BPD heads under sd and the trees (drafters/standard.py), and
# the lattice rescorings bpd_ngram[:P] and bpd_ngram_beam[:W] (Kim et al. 2024) -----------------


@dataclasses.dataclass(frozen=True)
class BPDOptions:
  """The BPD refinements' knobs (config `eval.bpd`; bpd_neural reads the rescorer fields).

  top_k: each head's candidates. paths: bpd_ngram keeps the P best of the k^h lattice paths,
    bpd_ngram_beam a beam of that width per level (a SHAPE number overrides it).
  ngram: the n-gram LM that rescores the lattice: a dataset whose train split is counted once
    (order `ngram_order`, cached beside the token cache) or a .npz from `models.ngram.save`.
  ngram_weight: w in (1 − w)·log q_head + w·log p_ngram (0 = the heads' ranking).
  rescorer: bpd_neural's LM, a model section (`configs.common.model`): a language-model
    drafter, e.g. the scratch quickstart's (`configs.common.SCRATCH_DRAFTER`); a feature
    drafter (the main job's) is refused, as it cannot run alone; rescorer_weight its share a
    of the score."""
  top_k: int = 4
  paths: int = 16
  ngram: str = "spec_jax_shakespeare"
  ngram_order: int = 4
  ngram_weight: float = 0.5
  rescorer: dict = dataclasses.field(default_factory=lambda: dict(
      size="drafter-s", checkpoint="runs/quickstart/drafter", dtype="float32"))
  rescorer_weight: float = 0.5

  def __post_init__(self):
    for name in ("top_k", "paths", "ngram_order"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"bpd.{name}={value!r} must be an integer >= 1.")
    for name in ("ngram_weight", "rescorer_weight"):
      if not 0.0 <= float(getattr(self, name)) <= 1.0:
        raise ValueError(f"bpd.{name}={getattr(self, name)} must be in [0, 1] (0 = the heads' "
                         "own scores).")


def check_depth(b_cfg: bpd_heads.BPDConfig, shape: trees.TreeSpec) -> None:
  """h heads draft chains and trees of depth at most h."""
  if shape.depth > b_cfg.num_heads:
    raise ValueError(
        f"drafter.checkpoint holds {b_cfg.num_heads} BPD heads: they draft chains and trees "
        f"of depth at most {b_cfg.num_heads}, not {shape.describe()} (depth {shape.depth}). "
        f"Fix: eval.gammas / the methods' @L <= {b_cfg.num_heads}.")


def heads_params(source, ngram_lm=None) -> dict:
  """The heads' drafter params from a loaded `methods.Source` (d_params: the heads), built once
  per source (with the n-gram LM under "ngram" when given)."""
  base = source.cached("bpd_params", lambda: BPDDrafter(source.b_cfg, source.v_cfg).params(
      source.d_params, source.v_params))
  if ngram_lm is None:
    return base
  ngram.check(ngram_lm, source.b_cfg.vocab_size, "eval.bpd.ngram")
  return {**base, "ngram": ngram_lm}


def ngram_lm(opts: BPDOptions, source):
  """The n-gram LM of `opts.ngram`: a .npz saved by `models.ngram.save`, or a dataset whose train
  split is counted once with the source's tokenizer (order opts.ngram_order) and cached beside
  the token cache. None when ngram_weight is 0 (the heads' ranking alone)."""
  if float(opts.ngram_weight) == 0:
    return None
  src = str(opts.ngram or "")
  if not src:
    raise ValueError("eval.methods has bpd_ngram(_beam) with eval.bpd.ngram_weight > 0, but "
                     "eval.bpd.ngram is empty. Fix: a dataset whose train split is counted "
                     "(e.g. --config.eval.bpd.ngram=spec_jax_shakespeare) or a saved .npz.")
  if src.endswith(".npz"):
    return source.cached(("ngram", src), lambda: ngram.load(src))

  def count():
    from spec_jax.data import pipeline  # noqa: PLC0415  (TFDS only when an n-gram is counted)
    from spec_jax.data import tokenizer as tokenizer_lib  # noqa: PLC0415
    order, tokenizer = int(opts.ngram_order), source.tokenizer
    path = os.path.join(pipeline.data_dir(source.data_dir), "spec_jax_ngram_cache",
                        f"{src}_{tokenizer_lib.cache_key(tokenizer)}_order{order}.npz")
    if os.path.exists(path):
      return ngram.load(path)
    logging.info("Counting a %d-gram LM on %s (train split) into %s.", order, src, path)
    lm = ngram.build(np.asarray(pipeline.token_stream(src, "train", tokenizer,
                                                      data_dir=source.data_dir)),
                     order=order, vocab_size=source.v_cfg.vocab_size)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ngram.save(lm, path)
    return lm
  return source.cached(("ngram", src, int(opts.ngram_order)), count)


def _ngram_method(beam: bool) -> methods.Method:
  """bpd_ngram (beam False: the P best paths) or bpd_ngram_beam (a width-W beam tree)."""
  name = "bpd_ngram_beam" if beam else "bpd_ngram"

  def rescoring(shape, opts) -> LatticeRescoring:
    return LatticeRescoring(int(opts.top_k), shape.width, float(opts.ngram_weight), beam=beam)

  def shape(ints, depth, opts, width):
    del width
    return lattice.shape(ints[0] if ints else int(opts.paths), depth, beam=beam)

  def check(source, shape, opts) -> None:
    check_depth(source.b_cfg, shape)
    rescoring(shape, opts).check(shape.depth, field="eval.bpd")

  def build(source, shape, opts) -> methods.Built:
    drafter = BPDDrafter(source.b_cfg, source.v_cfg, gamma=shape.depth,
                         rescore=rescoring(shape, opts))
    # One call of all the heads (c = 0: their cost is in the measured speedup).
    return methods.Built(drafter, heads_params(source, ngram_lm(opts, source)),
                         methods.Cost(calls=1), name, exact_law=False)

  return methods.Method(
      name, ("the tree of a width-W beam search over the heads' lattice" if beam else
             "the P best lattice paths of BPD heads") + " under an n-gram rescoring (greedy only)",
      build=build, shape=shape, grammar="W" if beam else "P", kinds=("bpd",), greedy_only=True,
      options=BPDOptions, options_field="bpd", check=check,
      example=f"{name}:{4 if beam else 16}@3")


methods.register(_ngram_method(beam=False))
methods.register(_ngram_method(beam=True))
