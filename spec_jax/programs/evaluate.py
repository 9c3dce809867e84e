"""Program `evaluate`: autoregressive vs speculative decoding over a prompt set.

For every (temperature, batch_size) it measures, in one process on the same prompts:
  * autoregressive decoding of the verifier (the speedup baseline),
  * autoregressive decoding of the drafter (to measure c = drafter step time / verifier call time),
  * speculative decoding for every γ in `eval.gammas`,
and writes one row per setting to `results.json` (metric names from DESIGN.md §3), a markdown
table `results.md` and PNG plots (τ vs γ, speedup vs γ). Timings exclude compilation: each
setting is compiled for the first batch's shapes (nothing decoded) before the timed pass, which
then runs every batch once. Each speculative row also carries r(M), the verifier's measured cost
for the M tokens of one call over one token at the same batch size (`verifier_cost_ratio_r`),
and the theoretical speedup τ / (r(M) + d·c) it implies.
Metrics come from spec_jax.evaluation.metrics, timings from spec_jax.evaluation.timing.
Every field is validated, and the cache room of the actual prompts checked, before any model
loads. Each finished row goes to `rows.jsonl` as it completes; a rerun reads finished rows back
unless a field they depend on changed (`row_digest`: adding γs, methods or temperatures keeps
them; a (T, B) with rows left measures its autoregressive baseline again).
"""

from __future__ import annotations

import hashlib
import json
import os

from absl import logging
import jax
import ml_collections
import numpy as np

from spec_jax import loading, parallel
from spec_jax.data import prompts as prompts_lib
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.decoding import generate as generate_lib
from spec_jax.decoding import sampling as sampling_lib
from spec_jax.decoding import loop
from spec_jax.decoding import verifier as verifier_lib
from spec_jax.decoding.drafters import bpd, bpd_neural, features, lattice, lookup, steered
from spec_jax.decoding.drafters import trees
from spec_jax.evaluation import metrics, quality, report, tables, timing
from spec_jax.models import draft_init, llama, steering


CONSOLE_COLUMNS = ("method", "tree", "gamma", "block_efficiency", "tau_se", "acceptance_rate",
                   "tokens_per_s", "speedup", "theoretical_speedup")

# Speculative methods by name; each row of results.json names one. "sd" is chain speculative
# decoding; every method runs in the one loop (decoding/loop.py) with an LM drafter of its shape.
# With BPD heads as the drafter (a train_bpd checkpoint), rows are named bpd (chains) and
# bpd_tree (trees from the heads' lattice), and the refinements run (eval.bpd): bpd_ngram[:P]
# verifies the P best lattice paths under an n-gram rescoring (greedy only), bpd_ngram_beam[:W]
# the tree of a width-W beam search under the same score (greedy only), bpd_neural drafts a
# chain whose per-head top-k is rescored by a small LM. Prompt lookup (drafters/lookup.py) needs
# no drafter model: lookup drafts the tokens that followed the text's last n-gram the last time it
# occurred, sd_lookup does that where an n-gram of eval.lookup.min_ngram+ tokens occurred and
# lets the drafter draft elsewhere.
NGRAM_METHODS = ("bpd_ngram", "bpd_ngram_beam")
BPD_METHODS = (*NGRAM_METHODS, "bpd_neural")
LOOKUP_METHODS = ("lookup", "sd_lookup")
METHODS = ("sd", *trees.TREE_METHODS, *BPD_METHODS, *LOOKUP_METHODS)


def parse_method(entry: str, depth: int | None, default_width: int, default_paths: int = 16):
  """One eval.methods entry → (method, draft depth, TreeSpec or None for a chain).

  Grammar: NAME[:SHAPE][@L]. SHAPE is K (chains for specinfer/spectr), W (rsd_s beam width) or
  b1-b2-... (rsd_c branching, padded with 1s to depth L); without it K = W = eval.tree_width and
  rsd_c branches eval.tree_width ways at the root only, so all tree methods spend the same
  1 + width·L verifier tokens per call. @L fixes the depth for this entry; otherwise the depth is
  each of eval.gammas in turn (`depth`). bpd_ngram:P keeps P lattice paths and
  bpd_ngram_beam:W a beam of width W per level (default eval.bpd.paths, `default_paths`);
  bpd_neural takes no shape."""
  head, _, at = entry.partition("@")
  name, _, shape = head.partition(":")
  if name not in METHODS:
    raise ValueError(f"eval.methods entry {entry!r}: unknown method {name!r}; known: "
                     f"{list(METHODS)} (autoregressive, the baseline, always runs).")
  try:
    depth = int(at) if at else depth
    ints = tuple(int(x) for x in shape.split("-")) if shape else ()
  except ValueError:
    raise ValueError(f"eval.methods entry {entry!r} does not parse; write NAME[:SHAPE][@L], e.g. "
                     "'rsd_c:3-2@4', 'rsd_s:4', 'spectr:3@2', 'sd@6'.") from None
  if name in ("sd", "bpd_neural", *LOOKUP_METHODS):
    if shape:
      raise ValueError(f"eval.methods entry {entry!r}: {name} drafts a chain: no shape, only "
                       "@γ.")
    return name, depth, None
  if name in NGRAM_METHODS:
    if len(ints) > 1:
      raise ValueError(f"eval.methods entry {entry!r}: {name} takes one number, the kept "
                       f"lattice paths P or beam width W (e.g. '{name}:16@3').")
    return name, depth, lattice.shape(ints[0] if ints else int(default_paths), depth,
                                      beam=name == "bpd_ngram_beam")
  if name != "rsd_c" and len(ints) > 1:
    raise ValueError(f"eval.methods entry {entry!r}: {name} takes one width, got {shape!r}.")
  if name == "rsd_c":
    spec = trees.TreeSpec(name, depth=depth, branching=ints or (int(default_width),))
  else:
    spec = trees.TreeSpec(name, depth=depth, width=ints[0] if ints else int(default_width))
  return name, depth, spec


def method_runs(ev) -> list[tuple[str, str, int, object]]:
  """(label, method, depth, TreeSpec | None) for every run eval.methods × eval.gammas asks for
  (entries with @L run once). Shapes are validated here, before anything is loaded."""
  runs = []
  for entry in ev.methods:
    depths = [None] if "@" in entry else list(ev.gammas)
    for depth in depths:
      name, d, spec = parse_method(entry, depth, ev.tree_width, _bpd_options(ev).paths)
      runs.append((entry.partition("@")[0], name, d, spec))
  return runs


def check_config(config, workdir: str, runs) -> None:
  """Every field evaluate reads, checked before any model loads (one error naming the field the
  user set and the fix); the cache room is checked once the prompts are known (`check_room`)."""
  ev = config.eval
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir!r} is a file; results go into a directory. Fix: pass "
                     "a directory path (it is created if missing).")
  for field in ("gammas", "temperatures", "batch_sizes"):
    if not tuple(ev[field]):
      raise ValueError(f"eval.{field} is empty: give at least one value.")
  for g in ev.gammas:
    if int(g) < 1:
      raise ValueError(f"eval.gammas has {g}: a draft length must be >= 1.")
  for t in ev.temperatures:
    if float(t) < 0:
      raise ValueError(f"eval.temperatures has {t}: a temperature must be >= 0 (0 = greedy).")
    try:
      sampling_lib.Sampling(float(t), int(ev.top_k), float(ev.top_p))
    except ValueError as e:  # top_k / top_p: name the eval fields
      raise ValueError(str(e).replace("sampling.", "eval.")) from None
  for b in ev.batch_sizes:
    if int(b) < 1:
      raise ValueError(f"eval.batch_sizes has {b}: a batch size must be >= 1.")
  for name in ("num_prompts", "new_tokens", "max_prompt_tokens", "max_cache_len"):
    if int(ev[name]) < 1:
      raise ValueError(f"eval.{name}={ev[name]} must be >= 1.")
  if int(ev.get("timing_repeats", 1)) < 1:
    raise ValueError(f"eval.timing_repeats={ev.timing_repeats} must be >= 1 (timed passes per "
                     "prompt batch; their median counts).")
  if {r[1] for r in runs} & set(BPD_METHODS):
    opts = _bpd_options(ev)
    for name in ("top_k", "paths", "ngram_order"):
      if isinstance(opts[name], bool) or not isinstance(opts[name], int) or opts[name] < 1:
        raise ValueError(f"eval.bpd.{name}={opts[name]!r} must be an integer >= 1.")
    for name in ("ngram_weight", "rescorer_weight"):
      if not 0.0 <= float(opts[name]) <= 1.0:
        raise ValueError(f"eval.bpd.{name}={opts[name]} must be in [0, 1] (0 = the heads' "
                         "own scores).")
  if {r[1] for r in runs} & set(LOOKUP_METHODS):
    opts = _lookup_options(ev)
    for name in ("max_ngram", "min_ngram"):
      if isinstance(opts[name], bool) or not isinstance(opts[name], int):
        raise ValueError(f"eval.lookup.{name}={opts[name]!r} must be an integer >= 1.")
    lookup.check_ngrams(opts.max_ngram, opts.min_ngram)
  for field, values in (("epsilon", [ev.epsilon]), ("epsilons", ev.get("epsilons", ()) or ())):
    for e in values:
      if not 0.0 < float(e) <= 1.0:
        raise ValueError(f"eval.{field} has {e}: lenience ε must be in (0, 1] (1 = lossless).")
  for t in ev.temperatures:  # every rule fits every run's shape at every temperature
    sampling = sampling_lib.Sampling(float(t), int(ev.top_k), float(ev.top_p))
    for _, name, depth, tree in runs:
      if name in NGRAM_METHODS and not sampling.greedy:
        raise ValueError(f"eval.methods has {name}, which verifies a deterministic set of "
                         f"lattice paths (no exact law): greedy only, but eval.temperatures has "
                         f"{t}. Fix: temperatures=(0,) for it, or sample with bpd / bpd_neural.")
      for e in _epsilons(ev, tree):
        try:
          _decode_config(ev, tree, e).resolve(tree or trees.chain(int(depth)), sampling)
        except ValueError as err:
          raise ValueError(f"At eval.temperatures entry {t}: " + str(err).replace(
              "decode.rule", "eval.rule" if tree is None else "eval.tree_rule").replace(
                  "decode.", "eval.")) from None


def _save_text(workdir: str, texts, token_lists, tokenizer, **setting) -> None:
  """eval.save_text: append each prompt's speculative continuation to texts.jsonl."""
  with open(os.path.join(workdir, "texts.jsonl"), "a", encoding="utf-8") as f:
    for prompt, ids in zip(texts, token_lists):
      f.write(json.dumps({**setting, "prompt": prompt, "completion": tokenizer.decode(ids)})
              + "\n")


def check_room(ev, batches, runs) -> None:
  """The cache must hold the longest padded prompt + eval.new_tokens + the widest proposal's
  overhang; the error names the numbers and the fields to change."""
  longest = max(p.tokens.shape[1] for p, _ in batches)
  overhang = max([int(d) if tree is None else tree.num_nodes - 1 for _, _, d, tree in runs],
                 default=0)
  total = longest + int(ev.new_tokens) + overhang
  if total > int(ev.max_cache_len):
    raise ValueError(
        f"The cache needs {total} slots (padded prompt {longest} tokens + eval.new_tokens="
        f"{ev.new_tokens} + {overhang} for the largest draft) but eval.max_cache_len="
        f"{ev.max_cache_len}. Fix: lower eval.new_tokens, eval.max_prompt_tokens or the "
        "largest γ / tree, or raise eval.max_cache_len if the model's context allows.")


ROWS = "rows.jsonl"  # every finished row as it completes: a rerun of the same config resumes


# The config fields a row's numbers depend on. Each row's key names its temperature, batch size,
# method, γ and ε, so the sweep lists (_SWEEPS) are left out of the digest, and so is whatever only
# shapes the report (title, save_text, an experiment's own fields): a rerun that adds a γ, a
# method or a title keeps the finished rows; one that changes a model, the prompts, the seed or a
# decoding option starts afresh.
_ROW_FIELDS = ("seed", "tokenizer", "mesh", "verifier", "drafter", "data", "prompts",
               "prompts_file", "num_data_prompts", "data_prompt_tokens", "eval")
_SWEEPS = ("methods", "gammas", "temperatures", "batch_sizes", "epsilons", "save_text")
_LOOKUP_DEFAULTS = {"max_ngram": 3, "min_ngram": 2}


def row_digest(config) -> str:
  """sha256 of the config fields every finished row depends on (_ROW_FIELDS, less _SWEEPS)."""
  fields = json.loads(config.to_json_best_effort())
  kept = {k: fields.get(k) for k in _ROW_FIELDS}
  kept["eval"] = {k: v for k, v in (kept["eval"] or {}).items() if k not in _SWEEPS}
  if kept["eval"].get("timing_repeats", 1) == 1:  # rows from before the field keep their digest
    kept["eval"].pop("timing_repeats", None)
  if kept["eval"].get("lookup", _LOOKUP_DEFAULTS) == _LOOKUP_DEFAULTS:  # likewise
    kept["eval"].pop("lookup", None)
  return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


class _RowLog:
  """Finished rows in <workdir>/rows.jsonl, each under a key naming its run and tagged with
  `row_digest` of the config: a rerun whose rows would come out the same reads them back instead
  of decoding again; any other config starts afresh (its rows replace the file's)."""

  def __init__(self, workdir: str, config):
    self.path = os.path.join(workdir, ROWS)
    self.digest = row_digest(config)
    self.done = {}
    if os.path.exists(self.path):
      with open(self.path, encoding="utf-8") as f:
        for line in f:
          try:
            record = json.loads(line)
          except json.JSONDecodeError:  # a line cut short by a kill
            continue
          if record.get("config") == self.digest:
            self.done[record["key"]] = record["row"]
    if not self.done and os.path.exists(self.path):
      os.replace(self.path, self.path + ".previous")

  def add(self, key: str, row: dict) -> None:
    self.done[key] = row
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"key": key, "config": self.digest, "row": row}) + "\n")


def _batches(tokenizer, texts, batch_size, max_prompt_tokens):
  """Prompt batches of exactly batch_size rows (the last one padded by repeating its last prompt;
  padded rows are dropped from every count)."""
  out = []
  for start in range(0, len(texts), batch_size):
    chunk = texts[start:start + batch_size]
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - real)
    out.append((generate_lib.encode_prompts(tokenizer, chunk, max_prompt_tokens,
                                            field="eval.max_prompt_tokens"), real))
  return out


def _bpd_options(ev):
  """eval.bpd with its defaults (configs/evaluate.py): the BPD refinements' knobs."""
  return ml_collections.ConfigDict(dict(
      dict(top_k=4, paths=16, ngram="", ngram_order=4, ngram_weight=0.5, rescorer=None,
           rescorer_weight=0.5), **(ev.get("bpd") or {})))


def _lookup_options(ev):
  """eval.lookup with its defaults (configs/evaluate.py): the n-gram lengths prompt lookup
  matches."""
  return ml_collections.ConfigDict(dict(dict(_LOOKUP_DEFAULTS),
                                        **(ev.get("lookup") or {})))


def _check_lookup_drafter(b_cfg, s_cfg) -> None:
  """sd_lookup lays the lookup over an LM or feature drafter: BPD heads and steered drafters
  are refused, naming the field."""
  if b_cfg is not None or s_cfg is not None:
    held = "BPD heads" if b_cfg is not None else "a steered drafter"
    raise ValueError(
        "eval.methods has sd_lookup, which lays prompt lookup over an LM or feature drafter, "
        f"but drafter.checkpoint holds {held}. Fix: lookup (no drafter model) or sd with this "
        "checkpoint.")


def make_drafter(d_cfg, s_cfg, shape, b_cfg=None, method: str = "sd", bpd_opts=None,
                 rescorer_cfg=None, lookup_opts=None):
  """An LM drafter of `shape`, steered (SD²) when the checkpoint carries a module (s_cfg); BPD
  heads (b_cfg, d_cfg then the verifier's config) draft chains and lattice trees of up to h
  tokens, refined by `method` bpd_ngram / bpd_ngram_beam / bpd_neural (options `bpd_opts`,
  eval.bpd); prompt lookup alone (`lookup`, V from d_cfg) or over the LM or feature drafter
  (`sd_lookup`), options `lookup_opts` (eval.lookup)."""
  if method in LOOKUP_METHODS:
    opts = lookup_opts or _lookup_options({})
    if method == "lookup":
      return lookup.PromptLookupDrafter(d_cfg.vocab_size, shape, int(opts.max_ngram))
    _check_lookup_drafter(b_cfg, s_cfg)
    return lookup.LookupOverlay(features.for_model(d_cfg, shape), int(opts.max_ngram),
                                int(opts.min_ngram))
  if method in BPD_METHODS and b_cfg is None:
    raise ValueError(f"eval.methods has {method}, which refines the drafts of BPD heads, but "
                     "drafter.checkpoint is not a train_bpd checkpoint. Fix: "
                     "--config.drafter.checkpoint=<a train_bpd workdir>, or drop the entry.")
  if b_cfg is not None:
    if shape.depth > b_cfg.num_heads:
      raise ValueError(
          f"drafter.checkpoint holds {b_cfg.num_heads} BPD heads: they draft chains and trees "
          f"of depth at most {b_cfg.num_heads}, not {shape.describe()} (depth {shape.depth}). "
          f"Fix: eval.gammas / the methods' @L <= {b_cfg.num_heads}.")
    if method in NGRAM_METHODS:
      return bpd.BPDDrafter(b_cfg, d_cfg, gamma=shape.depth, rescore=bpd.LatticeRescoring(
          int(bpd_opts.top_k), shape.width, float(bpd_opts.ngram_weight),
          beam=method == "bpd_ngram_beam"))
    if method == "bpd_neural":
      return bpd_neural.NeuralRescoredBPD(b_cfg, d_cfg, rescorer_cfg, gamma=shape.depth,
                                          top_k=int(bpd_opts.top_k),
                                          weight=float(bpd_opts.rescorer_weight))
    return bpd.BPDDrafter(b_cfg, d_cfg, gamma=shape.depth, tree=shape)
  if s_cfg is None:
    return features.for_model(d_cfg, shape)
  return steered.SteeredDrafter(d_cfg, s_cfg, shape)


def _speculative_fn(v_params, d_params, rng, *, v_cfg, d_cfg, s_cfg, b_cfg, shape, decode, ev,
                    common, method="sd", rescorer_cfg=None):
  """(prompts, batch index) -> the decoding loop's output for one run: the one place evaluate
  calls the speculative loop (an LM drafter of `shape`, a chain or a tree, steered or not; or
  BPD heads, refined or not)."""
  drafter = make_drafter(d_cfg, s_cfg, shape, b_cfg, method, _bpd_options(ev), rescorer_cfg,
                         _lookup_options(ev))
  verifier = verifier_lib.lm_verifier(v_cfg, drafter.verifier_layers)
  return lambda prompts, i, **kw: loop.speculative_generate(
      v_params, d_params, prompts, jax.random.fold_in(rng, i), verifier=verifier,
      drafter=drafter, decode=decode, max_cache_len=ev.max_cache_len, **common, **kw)


def _decode_config(ev, tree, epsilon) -> loop.DecodeConfig:
  """The verification knobs of one run: eval.rule for chains, eval.tree_rule for trees."""
  return loop.DecodeConfig(rule=ev.rule if tree is None else ev.tree_rule,
                           lenience=ev.lenience, epsilon=float(epsilon),
                           relaxed_top_k=int(ev.get("relaxed_top_k", 2)))


def _row_method(method: str, tree, b_cfg) -> str:
  """The results.json name: BPD heads' plain chains are `bpd`, their lattice trees `bpd_tree`."""
  if b_cfg is None or method in BPD_METHODS:
    return method
  return "bpd" if tree is None else "bpd_tree"


def _ngram_lm(opts, tokenizer, vocab_size: int, data_dir: str | None = None):
  """The n-gram LM of eval.bpd.ngram: a .npz saved by `models.ngram.save`, or a dataset name
  whose train split is counted once with this tokenizer (order eval.bpd.ngram_order) and cached
  beside the token cache."""
  from spec_jax.data import pipeline  # noqa: PLC0415  (TFDS only when an n-gram is counted)
  from spec_jax.models import ngram  # noqa: PLC0415
  src = str(opts.ngram or "")
  if not src:
    raise ValueError("eval.methods has bpd_ngram(_beam) with eval.bpd.ngram_weight > 0, but "
                     "eval.bpd.ngram is empty. Fix: a dataset whose train split is counted "
                     "(e.g. --config.eval.bpd.ngram=spec_jax_shakespeare) or a saved .npz.")
  if src.endswith(".npz"):
    return ngram.load(src)
  order = int(opts.ngram_order)
  path = os.path.join(pipeline.data_dir(data_dir), "spec_jax_ngram_cache",
                      f"{src}_{tokenizer.fingerprint}_order{order}.npz")
  if os.path.exists(path):
    return ngram.load(path)
  logging.info("Counting a %d-gram LM on %s (train split) into %s.", order, src, path)
  lm = ngram.build(np.asarray(pipeline.token_stream(src, "train", tokenizer, data_dir=data_dir)),
                   order=order, vocab_size=vocab_size)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  ngram.save(lm, path)
  return lm


def _verifier_cost_ratio(v_params, v_cfg, prompts, new_tokens: int, m: int) -> float:
  """r(M) of the verifier at this batch's size, with the loop's cache size (prompt + new tokens
  + the last round's overhang of M) and the M tokens halfway through the new tokens."""
  b, p = prompts.tokens.shape
  size = p + new_tokens + m
  return timing.verifier_cost_ratio(llama.make_apply(v_cfg), v_params,
                                    lambda: llama.init_cache(v_cfg, b, size), batch_size=b, m=m,
                                    position=p + new_tokens // 2)


def _feature_cost_ratio(v_params, v_cfg, d_params, d_cfg, prompts, new_tokens: int) -> float:
  """c of a feature drafter, which cannot generate alone (it reads the verifier's features):
  its one-token forward over the verifier's, timed taking turns (median of 5), at the loop's
  cache size and halfway through the new tokens."""
  b, p = prompts.tokens.shape
  size = p + new_tokens + 1
  calls = {}
  for name, cfg, params in (("v", v_cfg, v_params), ("d", d_cfg, d_params)):
    calls[name] = timing.forward_calls(features.timing_apply(cfg), params,
                                       lambda cfg=cfg: llama.init_cache(cfg, b, size),
                                       batch_size=b, tokens=(1,),
                                       position=p + new_tokens // 2)[1]
  times = timing.round_robin(calls, 5)
  return times["d"]["median_s"] / times["v"]["median_s"]


def _round(value, digits=4):
  return None if value is None else round(float(value), digits)


def _quality(v_params, d_params, outputs, batches, **kwargs) -> dict:
  """verifier_loglik and token_tv (spec_jax.evaluation.quality) over the real rows."""
  return quality.summarize(
      {k: v[:real] for k, v in quality.quality_sums(v_params, d_params, out, **kwargs).items()}
      for out, (_, real) in zip(outputs, batches))


def _epsilons(ev, tree) -> tuple:
  """ε values to sweep for one run: eval.epsilons (if set) for lenient chain SD, else ε."""
  if tree is None and ev.rule == "lenient" and ev.get("epsilons"):
    return tuple(ev.epsilons)
  return (ev.epsilon,)


def prompt_batches(config, tokenizer, runs) -> tuple[list[str], dict[int, list]]:
  """(the eval.num_prompts prompt texts, batch size -> [(Prompts, real rows)]), the cache room
  each run needs checked: all before any model loads."""
  ev = config.eval
  texts = prompts_lib.take(
      prompts_lib.read_prompts(config, tokenizer,
                               num_data_prompts=max(int(ev.num_prompts),
                                                    int(config.get("num_data_prompts", 0)))
                               if config.get("num_data_prompts", 0) else None),
      int(ev.num_prompts), "eval.num_prompts")
  all_batches = {b: _batches(tokenizer, texts, b, ev.max_prompt_tokens) for b in ev.batch_sizes}
  for batches in all_batches.values():
    check_room(ev, batches, runs)
  return texts, all_batches


def run(config, workdir: str) -> list[dict]:
  ev = config.eval
  runs = method_runs(ev)  # bad method entries fail before anything is loaded
  check_config(config, workdir, runs)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    f.write(config.to_json_best_effort(indent=2))
  mesh = parallel.decode_mesh(config.mesh)
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  texts, all_batches = prompt_batches(config, tokenizer, runs)
  b_cfg = loading.drafter_bpd(config.drafter)
  s_cfg = loading.drafter_steering(config.drafter)
  methods = {run[1] for run in runs}
  if "sd_lookup" in methods:  # before loading: it needs an LM or feature drafter
    _check_lookup_drafter(b_cfg, s_cfg)
  for run in runs:  # BPD methods need BPD heads, and every shape must fit them: before loading
    if run[1] in LOOKUP_METHODS:
      continue
    if b_cfg is not None or run[1] in BPD_METHODS:
      make_drafter(None, None, run[3] or trees.chain(int(run[2])), b_cfg,
                   "sd" if run[1] == "bpd_neural" and b_cfg is not None else run[1],
                   _bpd_options(ev))
  v_cfg, v_params = loading.load_model(config.verifier, tokenizer, seed=config.seed,
                                       field="verifier.checkpoint")
  d_cfg, d_params = loading.load_model(config.drafter, tokenizer, seed=config.seed + 1,
                                       field="drafter.checkpoint")
  draft_init.check_feature_width(v_cfg, d_cfg,
                                 f"drafter.checkpoint={config.drafter.checkpoint!r}")
  if s_cfg is not None:
    steering.check_verifier(s_cfg, v_cfg, f"drafter.checkpoint={config.drafter.checkpoint!r}")
  opts, rescorer_cfg = _bpd_options(ev), None
  if b_cfg is not None:  # BPD heads: no drafter model; they share the verifier's projection
    lm = (_ngram_lm(opts, tokenizer, v_cfg.vocab_size, config.data.get("data_dir") or None)
          if set(NGRAM_METHODS) & set(methods) and float(opts.ngram_weight) > 0 else None)
    d_params = bpd.BPDDrafter(b_cfg, v_cfg).params(d_params, v_params, lm)
    if "bpd_neural" in methods:
      if not opts.rescorer:
        raise ValueError("eval.methods has bpd_neural but eval.bpd.rescorer is not set. Fix: "
                         "a model section, e.g. --config.eval.bpd.rescorer.checkpoint="
                         "runs/quickstart/drafter (a train_lm or distill workdir).")
      rescorer_cfg, d_params["lm"] = loading.load_model(
          opts.rescorer, tokenizer, seed=config.seed + 2, field="eval.bpd.rescorer.checkpoint")
    d_cfg = v_cfg
  probe = make_drafter(d_cfg, s_cfg, trees.chain(1), b_cfg)
  if b_cfg is not None:  # every draft shape asked for must fit the heads, before any decoding
    for run in runs:
      make_drafter(d_cfg, s_cfg, run[3] or trees.chain(int(run[2])), b_cfg, run[1], opts,
                   rescorer_cfg)
  loop.check_pair(verifier_lib.lm_verifier(v_cfg, probe.verifier_layers), probe)
  # The drafter alone (its cost c, its teacher-forced law for token_tv): a steered drafter's
  # module is left out of both (its cost is in the measured speedup; token_tv is not reported).
  # BPD heads have no drafter model: c = 0 (their cost is in the measured speedup).
  lm_params = d_params["drafter"] if s_cfg is not None else d_params
  if mesh is not None:  # every batch size and both models fit the mesh, before any decoding
    for batch_size in ev.batch_sizes:
      parallel.check_decode_mesh(mesh, batch_size, {"verifier": v_cfg.n_kv_heads,
                                                    "drafter": d_cfg.n_kv_heads},
                                 batch_field=f"eval.batch_sizes entry {batch_size}: the batch size")
    v_params, d_params = parallel.place_params(v_params, mesh), parallel.place_params(d_params, mesh)
  # eval.num_prompts is the one count: it sets how many data prompts are drawn too.
  stop_ids = tokenizer.stop_ids if ev.stop_at_eos else ()
  device = timing.device_description()
  rows = []
  log = _RowLog(workdir, config)
  cost_ratios = {}  # r(M) per (batch size, M): measured once, shared by every temperature
  for temperature in ev.temperatures:
    sampling = sampling_lib.Sampling(float(temperature), int(ev.top_k), float(ev.top_p))
    for batch_size in ev.batch_sizes:
      batches = all_batches[batch_size]
      prompts, reals = [p for p, _ in batches], [r for _, r in batches]
      rng = jax.random.key(config.seed)
      common = dict(sampling=sampling, max_new_tokens=ev.new_tokens, stop_ids=stop_ids,
                    mesh=mesh)
      label = f"T={temperature:g} B={batch_size}"
      jobs = [(r, e) for r in runs for e in _epsilons(ev, r[3])]
      keys = [f"{label} {r[0]} γ={r[2]} ε={e}" for r, e in jobs]
      ar_key = f"{label} autoregressive"
      if ar_key in log.done and all(k in log.done for k in keys):
        rows += [log.done[ar_key]] + [log.done[k] for k in keys]
        logging.info("%s: every row read back from %s.", label, log.path)
        continue

      def ar(params, cfg):
        return lambda prompts, i, **kw: generate_lib.generate(
            params, prompts, jax.random.fold_in(rng, i), cfg=cfg, **common, **kw)

      ar_usage = {}
      repeats = int(ev.get("timing_repeats", 1))
      ar_out, ar_s = timing.timed_pass(ar(v_params, v_cfg), prompts,
                                       desc=f"{label} autoregressive", compile_only=True,
                                       usage=ar_usage, repeats=repeats)
      ar_tokens = metrics.token_lists(ar_out, reals)
      n_ar = metrics.emitted_tokens(ar_out, reals)
      ar_tps = n_ar / ar_s
      feature_drafter = b_cfg is None and bool(d_cfg.feature_width)
      if b_cfg is None and not feature_drafter:
        d_out, d_s = timing.timed_pass(ar(lm_params, d_cfg), prompts,
                                       desc=f"{label} drafter-only", compile_only=True,
                                       repeats=repeats)
      c_rescorer = 0.0  # bpd_neural's LM, one call per draft: its cost relative to the verifier
      if rescorer_cfg is not None:
        r_out, r_s = timing.timed_pass(ar(d_params["lm"], rescorer_cfg), prompts,
                                       desc=f"{label} rescorer-only", compile_only=True)
        c_rescorer = (timing.seconds_per_step(r_out, r_s)
                      / timing.seconds_per_step(ar_out, ar_s))
      ar_quality = _quality(v_params, None, ar_out, batches, verifier_cfg=v_cfg,
                            drafter_cfg=None, sampling=sampling)
      if b_cfg is not None:
        c = 0.0
      elif feature_drafter:
        c = _feature_cost_ratio(v_params, v_cfg, lm_params, d_cfg, prompts[0], ev.new_tokens)
      else:
        c = timing.seconds_per_step(d_out, d_s) / timing.seconds_per_step(ar_out, ar_s)
      base = dict(temperature=float(temperature), top_k=int(ev.top_k), top_p=float(ev.top_p),
                  batch_size=batch_size, num_prompts=len(texts), device=device,
                  seed=config.seed, dataset=prompts_lib.prompt_source(config), cost_ratio_c=round(c, 4),
                  verifier=config.verifier.checkpoint or config.verifier.size,
                  drafter=config.drafter.checkpoint or config.drafter.size)
      # A (T, B) with rows still to do measures its baseline again, in this process.
      rows.append(dict(base, method="autoregressive", gamma=None, new_tokens=n_ar,
                       block_efficiency=1.0, mean_accepted_tokens=0.0, acceptance_rate=None,
                       empirical_acceptance=None, per_position_acceptance=None,
                       verifier_calls=sum(int(o.steps) for o in ar_out), drafter_calls=0,
                       tokens_per_s=round(ar_tps, 2), cpu_per_wall=ar_usage["cpu_per_wall"],
                       speedup=1.0, verifier_cost_ratio_r=1.0,
                       theoretical_speedup=1.0,
                       speedup_vs_theory=None, verifier_tokens_per_call=1,
                       identical_to_greedy=True if sampling.greedy else None,
                       verifier_loglik=round(ar_quality["verifier_loglik"], 4), token_tv=None))
      log.add(ar_key, rows[-1])
      for ((label_m, method, gamma, tree), epsilon), key in zip(jobs, keys):
        if key in log.done:
          rows.append(log.done[key])
          continue
        shape = trees.chain(int(gamma)) if tree is None else tree
        decode = _decode_config(ev, tree, epsilon)
        rule_name, _ = decode.resolve(shape, sampling)
        fn = _speculative_fn(v_params, d_params, rng, v_cfg=v_cfg, d_cfg=d_cfg, s_cfg=s_cfg,
                             b_cfg=b_cfg, shape=shape, decode=decode, ev=ev, common=common,
                             method=method, rescorer_cfg=rescorer_cfg)
        sd_usage = {}
        sd_out, sd_s = timing.timed_pass(fn, prompts, desc=f"{label} {label_m} γ={gamma}",
                                         compile_only=True, usage=sd_usage, repeats=repeats)
        sd_tokens = metrics.token_lists(sd_out, reals)
        if ev.get("save_text", False) and parallel.is_writer():
          _save_text(workdir, texts, sd_tokens, tokenizer, temperature=float(temperature),
                     batch_size=batch_size, method=label_m, gamma=int(gamma))
        summary = metrics.summarize(sd_out, reals)
        calls, tau = summary["verifier_calls"], summary["block_efficiency"]
        tokens_per_call = int(gamma) + 1 if tree is None else tree.num_nodes
        if (batch_size, tokens_per_call) not in cost_ratios:
          cost_ratios[batch_size, tokens_per_call] = _verifier_cost_ratio(
              v_params, v_cfg, prompts[0], ev.new_tokens, tokens_per_call)
        r_m = cost_ratios[batch_size, tokens_per_call]
        # Measured τ for chains and trees alike; one drafter call per draft depth (chain γ, tree
        # L levels). plots.tau_theory shows the i.i.d.-α prediction of τ beside it.
        # BPD: one call of all the heads, at no drafter cost (c = 0); bpd_neural adds its LM's
        # γ calls (catch-up window, then one per draft but the last).
        # Prompt lookup alone: no drafter model (c = 0; its n-gram search is in the measured
        # speedup). sd_lookup: the drafter's γ calls, an upper bound (matched rounds skip them).
        d_calls = 1 if b_cfg is not None else int(gamma)
        c_run = c
        if method == "bpd_neural":
          d_calls, c_run = int(gamma), c_rescorer
        if method == "lookup":
          d_calls, c_run = 0, 0.0
        theoretical = metrics.theoretical_speedup(tau, r_m=r_m, c=c_run, drafter_calls=d_calls)
        tps = summary["new_tokens"] / sd_s
        measured = tps / ar_tps
        lenient = rule_name == "lenient"
        # Quality cost of lossy decoding: the one-step law of the chain rule vs p (trees: their
        # rules are lossless, so only the log-likelihood is reported).
        # A feature drafter's law needs the verifier's features: no token_tv for it.
        alone = b_cfg is None and not feature_drafter and method not in LOOKUP_METHODS
        sd_quality = _quality(v_params, lm_params if alone else None, sd_out, batches,
                              verifier_cfg=v_cfg, sampling=sampling,
                              drafter_cfg=d_cfg if s_cfg is None and alone else None,
                              **(dict(lenience=decode.lenience, epsilon=decode.epsilon)
                                 if lenient else {}))
        rows.append(dict(
            base, method=_row_method(method, tree, b_cfg), gamma=int(gamma),
            cost_ratio_c=round(c_run, 4),
            rule=rule_name, tree=None if tree is None else tree.describe(),
            lenience=decode.lenience if lenient else None,
            epsilon=decode.epsilon if lenient else None,
            relaxed_top_k=decode.relaxed_top_k if rule_name == "top_k_relaxed" else None,
            new_tokens=summary["new_tokens"],
            block_efficiency=_round(tau), tau_se=_round(summary["tau_se"]),
            mean_accepted_tokens=_round(summary["mean_accepted_tokens"]),
            # α needs the drafter's law; bpd_ngram's kept paths have none (q = None).
            acceptance_rate=(None if method in NGRAM_METHODS
                             else _round(summary["acceptance_rate"])),
            empirical_acceptance=_round(summary["empirical_acceptance"]),
            per_position_acceptance=[_round(a) for a in summary["per_position_acceptance"]],
            candidates_per_call=_round(summary["candidates_per_call"]),
            verifier_calls=calls, drafter_calls=calls * d_calls,
            drafter_calls_per_round=d_calls,
            tokens_per_s=round(tps, 2), cpu_per_wall=sd_usage["cpu_per_wall"],
            speedup=round(measured, 4),
            verifier_cost_ratio_r=round(r_m, 4), theoretical_speedup=_round(theoretical),
            speedup_vs_theory=_round(measured / theoretical if theoretical else None),
            verifier_tokens_per_call=tokens_per_call,
            identical_to_greedy=(sd_tokens == ar_tokens) if sampling.greedy else None,
            verifier_loglik=round(sd_quality["verifier_loglik"], 4),
            token_tv=(round(sd_quality["token_tv"], 5)
                      if tree is None and s_cfg is None and rule_name != "top_k_relaxed"
                      and method not in LOOKUP_METHODS
                      else None)))
        log.add(key, rows[-1])
      # A narrow table on the console; results.md has every column.
      shown = [r for r in rows if r["temperature"] == float(temperature)
               and r["batch_size"] == batch_size]
      columns = [c for c in CONSOLE_COLUMNS if c != "tree" or any(r.get("tree") for r in shown)]
      print(f"\n{label}\n" + tables.markdown_table(shown, columns), flush=True)
  # The rows are in results.json and the tables above; benchmarks (benchmark_sd) also print them.
  report.write_results(workdir, rows, echo=config.get("print_json", False))
  report.write_report(workdir, rows, title=config.get("title", "spec_jax evaluation"),
                      config_text=str(config))
  return rows
