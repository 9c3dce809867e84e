"""The method registry: every speculative method is one `Method` entry, declared by its own
drafter module with `register`, and looked up by name by every program and experiment
(docs/design.md §9).

A user names a run `NAME[:SHAPE][@L]` (config `eval.methods`, generate's `method`): NAME a
registered method, SHAPE the numbers its `grammar` takes (a tree's width, a branching vector, kept
lattice paths), L the draft depth (else each of eval.gammas). An entry declares:
  options    a frozen dataclass of the method's knobs; its defaults are the only ones: the config
             sub-dict `<section>.<options_field>` overrides them field by field (`options`).
  kinds      the drafter checkpoints it runs with: "lm" (a language model or feature drafter),
             "steered" (an LM with an SD² steering module), "bpd" (BPD heads); `needs_model`
             False: it drafts without a drafter model (prompt lookup).
  greedy_only  its proposals have no exact law (only greedy verification keeps it lossless).
  shape      (numbers from SHAPE, depth, options, default width) -> the static `TreeSpec`.
  check      optional (source, shape, options) -> None, raising ValueError before any model
             loads (e.g. a depth the checkpoint's heads cannot draft).
  build      (source, shape, options) -> `Built`: the drafter, its own params, its cost model
             (drafter calls per round and which model's step is c) and the results.json name.
Nothing outside the drafter modules branches on a method name.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any, Callable

# The modules that declare the built-in methods, imported on first lookup (they import this
# module to register, so this module cannot import them at the top).
BUILTIN = ("spec_jax.decoding.drafters.standard", "spec_jax.decoding.drafters.dyn",
           "spec_jax.decoding.drafters.bpd", "spec_jax.decoding.drafters.bpd_neural",
           "spec_jax.decoding.drafters.lookup")
KINDS = ("lm", "steered", "bpd")

_REGISTRY: dict[str, "Method"] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class Cost:
  """A method's cost model for the theoretical speedup τ / (r(M) + d·c).

  calls: d, drafter calls per round.
  model: the name of the model whose one-token step is timed for c ("drafter", "rescorer"), or
    None for c = 0 (no drafter model, or one whose cost only the measured speedup shows).
  cfg, params: that model. features: it is a feature drafter (it cannot decode alone: c is its
    forward timed against the verifier's, `bench.feature_cost_ratio`).
  widths: the tokens each of the d calls feeds, where not all are 1 (a tree's
    `TreeSpec.call_widths`); empty: d one-token calls. A round then drafts for Σ_w c(w) instead
    of d·c, c(w) = c·s(w) with s(w) the model's w-token forward over its one-token one
    (`bench.call_cost_ratios`)."""
  calls: int
  model: str | None = None
  cfg: Any = None
  params: Any = None
  features: bool = False
  widths: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Built:
  """What a method's builder returns for one shape.

  drafter: a `protocols.Drafter`; params: its params (the loop's d_params).
  cost: its `Cost`. row_method: the name results.json rows carry.
  law: (cfg, params) of the model whose own next-token law the drafts follow, where a row may
    compare it with the verifier's (token_tv); None otherwise.
  exact_law: the proposals carry the exact law q they were drawn from (False: a deterministic
    set such as kept lattice paths, q = None: no α, greedy verification only)."""
  drafter: Any
  params: Any
  cost: Cost
  row_method: str
  law: tuple[Any, Any] | None = None
  exact_law: bool = True


@dataclasses.dataclass
class Source:
  """What a method builds from. Before loading: the drafter checkpoint's kind and the configs in
  its metadata (enough for every check). `loaded` fills the models.

  kind: one of KINDS. field: the config field that names the checkpoint (for errors).
  s_cfg: a steered checkpoint's steering config; b_cfg: a BPD checkpoint's heads config.
  v_cfg, v_params: the verifier. d_cfg, d_params: the drafter checkpoint (BPD: the verifier's
    config and the heads); None when no method needs it.
  tokenizer, data_dir, seed: for methods that build more (an n-gram LM, a rescoring LM).
  load_model: (model section, field, seed offset) -> (cfg, params), the program's loader.
  memo: per-source cache for what builders share between shapes (an n-gram LM, params)."""
  kind: str = "lm"
  field: str = "drafter.checkpoint"
  s_cfg: Any = None
  b_cfg: Any = None
  v_cfg: Any = None
  v_params: Any = None
  d_cfg: Any = None
  d_params: Any = None
  tokenizer: Any = None
  data_dir: str | None = None
  seed: int = 0
  load_model: Callable[..., tuple[Any, Any]] | None = None
  memo: dict = dataclasses.field(default_factory=dict)

  @property
  def features(self) -> bool:
    """The drafter checkpoint is a feature drafter (reads the verifier's residual)."""
    return self.kind == "lm" and bool(getattr(self.d_cfg, "feature_width", 0))

  def cached(self, key, make: Callable[[], Any]):
    if key not in self.memo:
      self.memo[key] = make()
    return self.memo[key]


@dataclasses.dataclass(frozen=True)
class Method:
  """One registry entry (module docstring)."""
  name: str
  summary: str
  build: Callable[[Source, Any, Any], Built]
  shape: Callable[[tuple[int, ...], int, Any, int], Any]
  grammar: str = ""  # SHAPE numbers: "" (a chain: only @γ), "K", "W", "P", "K-M", "b1-b2-..."
  kinds: tuple[str, ...] = KINDS
  needs_model: bool = True
  greedy_only: bool = False
  options: type | None = None
  options_field: str | None = None
  check: Callable[[Source, Any, Any], None] | None = None
  example: str = ""            # an entry that parses, for error messages


@dataclasses.dataclass(frozen=True)
class Entry:
  """One run of a method: its label (the entry without @L), method, depth, static shape and
  options."""
  label: str
  method: Method
  depth: int
  shape: Any
  options: Any

  @property
  def name(self) -> str:
    return self.method.name

  @property
  def tokens_per_call(self) -> int:
    """The verifier's budget per call: M nodes of the proposal (a chain: γ + 1)."""
    return self.shape.num_nodes


def register(method: Method) -> Method:
  """Add `method` to the registry (a name registered twice is an error: two modules disagree)."""
  if method.name in _REGISTRY and _REGISTRY[method.name] is not method:
    raise ValueError(f"method {method.name!r} is registered twice.")
  if method.options is not None and not method.options_field:
    raise ValueError(f"method {method.name!r} has options but no options_field.")
  for kind in method.kinds:
    if kind not in KINDS:
      raise ValueError(f"method {method.name!r}: unknown drafter kind {kind!r}; one of {KINDS}.")
  _REGISTRY[method.name] = method
  return method


def unregister(name: str) -> None:
  """Remove a method (tests that register their own)."""
  _REGISTRY.pop(name, None)


def _load_builtin() -> None:
  for module in BUILTIN:
    importlib.import_module(module)


def names() -> tuple[str, ...]:
  """Every registered method: the built-in modules' in BUILTIN order, then the others in the
  order they registered."""
  _load_builtin()
  rank = {module: i for i, module in enumerate(BUILTIN)}
  order = list(_REGISTRY)
  return tuple(sorted(order, key=lambda n: (rank.get(_REGISTRY[n].build.__module__, len(rank)),
                                            order.index(n))))


def get(name: str, field: str = "eval.methods") -> Method:
  """The method registered as `name`; ValueError naming `field` otherwise."""
  _load_builtin()
  if name not in _REGISTRY:
    raise ValueError(f"{field} has {name!r}, which is not a method; known: {list(names())} "
                     "(autoregressive decoding, the baseline, always runs). Fix: one of those, "
                     "or register a new one (docs/adding_a_method.md).")
  return _REGISTRY[name]


# --- options ---------------------------------------------------------------------------------


def option_groups() -> dict[str, type]:
  """{options_field: options dataclass} over every registered method."""
  _load_builtin()
  out = {}
  for m in _REGISTRY.values():
    if m.options is not None:
      if out.setdefault(m.options_field, m.options) is not m.options:
        raise ValueError(f"options field {m.options_field!r} has two dataclasses.")
  return out


def option_defaults() -> dict[str, dict]:
  """{options_field: {field: default}}: what configs put under their method section so that
  `--config.eval.<group>.<field>=...` overrides exist (the values come from here alone)."""
  return {group: dataclasses.asdict(cls()) for group, cls in option_groups().items()}


def _coerce(value, hint, field: str):
  """A config value as the options field's type; ValueError naming the field."""
  if hint in ("int", int):
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{field}={value!r} must be an integer.")
    return value
  if hint in ("float", float):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{field}={value!r} must be a number.")
    return float(value)
  if hint in ("str", str):
    return "" if value is None else str(value)
  if hint in ("bool", bool):
    if not isinstance(value, bool):
      raise ValueError(f"{field}={value!r} must be True or False.")
  return value


def options(method: Method, section, prefix: str = "eval"):
  """`method`'s options: its dataclass's defaults overridden by `section[options_field]` (a dict
  or ConfigDict; missing = all defaults). ValueError naming `<prefix>.<group>.<field>` for a field
  the method does not have or a value of the wrong type (the dataclass validates ranges)."""
  if method.options is None:
    return None
  group = method.options_field
  where = f"{prefix}.{group}" if prefix else group
  given = (section.get(group) if section is not None else None) or {}
  given = dict(given.items()) if hasattr(given, "items") else dict(given)
  fields = {f.name: f for f in dataclasses.fields(method.options)}
  hints = typing.get_type_hints(method.options)
  kwargs = {}
  for key, value in given.items():
    if key not in fields:
      raise ValueError(f"{where}.{key} is not an option of {method.name} (its options: "
                       f"{sorted(fields)}). Fix: drop it, or set it for the method that has it.")
    kwargs[key] = _coerce(value, hints.get(key), f"{where}.{key}")
  try:
    return method.options(**kwargs)
  except ValueError as e:  # the dataclass names `<group>.<field>`: prefix the section
    msg = str(e)
    raise ValueError(f"{prefix}.{msg}" if prefix and msg.startswith(f"{group}.") else msg
                     ) from None


# --- the NAME[:SHAPE][@L] grammar -----------------------------------------------------------


def parse(entry: str, depth: int | None, section=None, *, default_width: int = 3,
          field: str = "eval.methods", prefix: str = "eval") -> Entry:
  """One `NAME[:SHAPE][@L]` entry -> `Entry`. @L fixes the depth; otherwise `depth` (each of
  eval.gammas in turn). ValueError naming `field` for an unknown name, a SHAPE the method does not
  take, or no depth."""
  head, _, at = str(entry).partition("@")
  name, _, shape_text = head.partition(":")
  method = get(name, field)
  try:
    depth = int(at) if at else depth
    ints = tuple(int(x) for x in shape_text.split("-")) if shape_text else ()
  except ValueError:
    raise ValueError(f"{field} entry {entry!r} does not parse; write NAME[:SHAPE][@L], e.g. "
                     f"{method.example or name + '@4'!r}.") from None
  if ints and not method.grammar:
    raise ValueError(f"{field} entry {entry!r}: {name} drafts a chain: no shape, only @γ "
                     f"(e.g. '{name}@4').")
  if len(ints) > 1 and "-" not in method.grammar:
    raise ValueError(f"{field} entry {entry!r}: {name} takes one number {method.grammar}, got "
                     f"{shape_text!r} (e.g. {method.example!r}).")
  if depth is None or isinstance(depth, bool) or int(depth) < 1:
    raise ValueError(f"{field}={entry!r}: give a draft length >= 1 (NAME@L, or the depth "
                     "field: eval.gammas, generate's gamma).")
  opts = options(method, section, prefix)
  spec = method.shape(ints, int(depth), opts, int(default_width))
  return Entry(head, method, int(depth), spec, opts)


def entries(ev, *, field: str = "eval.methods") -> list[Entry]:
  """Every run eval.methods × eval.gammas asks for (entries with @L run once), parsed and their
  options read: all before anything loads."""
  out = []
  for entry in ev.methods:
    depths = [None] if "@" in str(entry) else list(ev.gammas)
    for depth in depths:
      out.append(parse(entry, depth, ev, default_width=int(ev.get("tree_width", 3)),
                       field=field))
  return out


# --- checks before loading, building after --------------------------------------------------


def check(entry: Entry, source: Source, sampling, *, field: str = "eval.methods",
          temperature_field: str = "eval.temperatures") -> None:
  """What `entry` needs, against the drafter checkpoint (`source`, before loading) and the
  sampling law: ValueError naming the field and the fix."""
  m = entry.method
  if m.needs_model and source.kind not in m.kinds:
    held = {"lm": "a language model", "steered": "a steered drafter",
            "bpd": "BPD heads"}[source.kind]
    wants = " or ".join({"lm": "a language or feature drafter", "steered": "a steered drafter",
                         "bpd": "BPD heads (a train_bpd workdir)"}[k] for k in m.kinds)
    raise ValueError(f"{field} has {entry.label}, which needs {wants}, but {source.field} holds "
                     f"{held}. Fix: point {source.field} at one, or drop the entry.")
  if m.greedy_only and not sampling.greedy:
    raise ValueError(f"{field} has {entry.label}, whose drafts have no exact law: greedy only, "
                     f"but {temperature_field} has {sampling.temperature:g}. Fix: temperature 0 "
                     "for it, or a method that samples.")
  if m.check is not None:
    m.check(source, entry.shape, entry.options)


def build(entry: Entry, source: Source) -> Built:
  """The drafter of one run, from a loaded source."""
  return entry.method.build(source, entry.shape, entry.options)


def needs_model(entries_: list[Entry]) -> bool:
  """Whether any run needs the drafter checkpoint loaded."""
  return any(e.method.needs_model for e in entries_)
