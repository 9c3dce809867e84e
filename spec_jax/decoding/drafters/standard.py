"""The standard methods over a drafter checkpoint: chain speculative decoding (`sd`; `sd_stop:C`,
whose rows stop drafting after a draft the drafter gave probability < C %), and the draft
trees RSD-C, RSD-S, SpecInfer and SpecTr (`trees.py`), registered in `decoding.methods`.

Each drafts with whatever the checkpoint holds: a language model (`lm.LMDrafter`), a feature
drafter (`features.FeatureDrafter`), a steered drafter (`steered.SteeredDrafter`) or BPD heads
(`bpd.BPDDrafter`: chains of up to h tokens and trees from the heads' lattice, rows named `bpd`
and `bpd_tree`, one heads call per round at no separate drafter cost).
Tree shapes: `rsd_c:b1-b2-...` (padded with 1s to depth L), `rsd_s:W`, `specinfer:K`,
`spectr:K`; without a shape K = W = eval.tree_width and rsd_c branches that many ways at the root
only, so every tree spends the same 1 + width·L verifier tokens per call. The dynamic tree `dyn`
(`dyn.py`) builds with the same drafters.
"""

from __future__ import annotations

from spec_jax.decoding import methods
from spec_jax.decoding.drafters import bpd, features, steered, trees


def model_drafter(source: methods.Source, shape: trees.TreeSpec):
  """The drafter of `shape` that the checkpoint's kind gives, and its params."""
  if source.kind == "bpd":
    drafter = bpd.BPDDrafter(source.b_cfg, source.v_cfg, gamma=shape.depth, tree=shape)
    return drafter, bpd.heads_params(source)
  if source.kind == "steered":
    return steered.SteeredDrafter(source.d_cfg, source.s_cfg, shape), source.d_params
  return features.for_model(source.d_cfg, shape), source.d_params


def model_cost(source: methods.Source, shape: trees.TreeSpec) -> methods.Cost:
  """One drafter call per draft level (chain γ, tree L), a tree's on the tokens of each level it
  feeds (`TreeSpec.call_widths`); BPD heads: one call of all heads, whose cost only the measured
  speedup shows (c = 0). A steered drafter is timed without its module."""
  if source.kind == "bpd":
    return methods.Cost(calls=1)
  params = source.d_params["drafter"] if source.kind == "steered" else source.d_params
  return methods.Cost(calls=shape.depth, model="drafter", cfg=source.d_cfg, params=params,
                      features=source.features,
                      widths=() if shape.is_chain else shape.call_widths)


def builder(name: str):
  """The `build` of a method drafting `shape` with the checkpoint's model (`model_drafter`), its
  rows named `name`."""
  def build(source: methods.Source, shape: trees.TreeSpec, opts) -> methods.Built:
    del opts
    drafter, params = model_drafter(source, shape)
    row = name
    if source.kind == "bpd":
      row = "bpd" if shape.is_chain else "bpd_tree"
    # The drafter's own next-token law, where rows compare it with the verifier's (token_tv): a
    # plain LM drafting a chain (a feature drafter's law needs the verifier's features).
    plain = source.kind == "lm" and not source.features and shape.is_chain
    return methods.Built(drafter, params, model_cost(source, shape), row,
                         law=(source.d_cfg, source.d_params) if plain else None)
  return build


def _check_depth(source: methods.Source, shape: trees.TreeSpec, opts) -> None:
  del opts
  if source.kind == "bpd":
    bpd.check_depth(source.b_cfg, shape)


# The papers' trees: each method's layout (how it grows, hence its sibling scheme) and the rule
# that verifies it exactly.
TREES = {"rsd_c": ("branching", "rrs_without"), "rsd_s": ("beam", "rrs_without"),
         "specinfer": ("chains", "rrs_with"), "spectr": ("chains", "kseq")}


def tree(method: str, depth: int, branching: tuple[int, ...] = (), width: int = 1
         ) -> trees.TreeSpec:
  """The draft tree `method` (one of TREES) grows: rsd_c with `branching`, the others `width`."""
  if method not in TREES:
    raise ValueError(f"tree method {method!r} is unknown; choose one of {list(TREES)}.")
  layout, rule = TREES[method]
  return trees.TreeSpec(layout, depth, tuple(branching), width, rule=rule, name=method)


def _chain(ints, depth, opts, width):
  del ints, opts, width
  return trees.chain(depth)


# The drafting stop of `sd_stop` without a SHAPE: HF transformers' default
# assistant_confidence_threshold.
DEFAULT_STOP = 0.4


def _stop_chain(ints, depth, opts, width):
  del opts, width
  percent = ints[0] if ints else round(DEFAULT_STOP * 100)
  if not 1 <= percent <= 99:
    raise ValueError(f"eval.methods entry sd_stop:{percent}: the stop is a percentage in 1..99 "
                     "(sd_stop:40 stops a row's drafting after a draft the drafter gave < 0.40).")
  return trees.chain(depth, stop=percent / 100)


def _build_stop(source: methods.Source, shape: trees.TreeSpec, opts) -> methods.Built:
  """sd's build, its rows named by the threshold (`sd_stop:40`): a sweep is one column each."""
  return builder(f"sd_stop:{round(shape.stop * 100)}")(source, shape, opts)


def _tree(name):
  def shape(ints, depth, opts, width):
    del opts
    if name == "rsd_c":
      return tree(name, depth, branching=ints or (width,))
    return tree(name, depth, width=ints[0] if ints else width)
  return shape


methods.register(methods.Method(
    "sd", "chain speculative decoding (Leviathan et al. 2023): γ drafts, one verifier call",
    build=builder("sd"), shape=_chain, check=_check_depth, example="sd@4"))
methods.register(methods.Method(
    "sd_stop", "chain SD that stops drafting a row after a draft its drafter gave probability "
    "< C% (HF transformers' assistant_confidence_threshold); the verifier scores only the drafts "
    "made, up to γ", build=_build_stop, shape=_stop_chain, grammar="C",
    kinds=("lm", "steered"), check=_check_depth, example="sd_stop:40@4"))
for _name, _grammar, _summary, _example in (
    ("rsd_c", "b1-b2-...", "RSD with constant branching (Jeon et al. 2024, §3.2)", "rsd_c:3-2@4"),
    ("rsd_s", "W", "RSD with stochastic beam search of width W (Jeon et al. 2024, §3.3)",
     "rsd_s:4@3"),
    ("specinfer", "K", "K i.i.d. draft chains, recursive rejection with replacement",
     "specinfer:3@2"),
    ("spectr", "K", "K i.i.d. draft chains, SpecTr's K-SEQ", "spectr:3@2")):
  methods.register(methods.Method(_name, _summary, build=builder(_name), shape=_tree(_name),
                                  grammar=_grammar, check=_check_depth, example=_example))
