"""Checkpoints: Orbax `CheckpointManager` under `<workdir>/checkpoints/<step>/`.

Each step directory holds three items:
  params/  the model params (StandardSave), all that `load_model` needs;
  train/   {"step", "opt_state"} (StandardSave), needed only to resume training;
  meta/    JSON: {"format", "step", "model" (LlamaConfig fields), "tokenizer" {name, fingerprint,
           vocab_size}, "config" (the run's whole ConfigDict)}.
Keeping params apart from the optimizer state lets evaluate/generate load a drafter with nothing
but its model config (from meta), and keeps a frozen verifier's params out of student checkpoints.

Orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-save leaves no half-written step that `restore_latest` would pick up.

Integrity (`integrity.py`): meta also records a digest of every array and of the meta itself,
committed with the arrays. Every load verifies them: a corrupt step (changed bytes, or files that
no longer decode) is a `CorruptCheckpointError` naming its path, step and array. Evaluation and
generation (`load_model`) refuse it; a training run resumes from the newest intact step and moves
the corrupt ones to `<workdir>/checkpoints_corrupt/` with a warning (`resume_or_start`).
Checkpoints written before digests existed have none and load unverified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
from typing import Any, Callable

from absl import logging
import jax
import orbax.checkpoint as ocp

from spec_jax.models import bpd_heads, families, llama, steering
from spec_jax.training import integrity

FORMAT = 1
_ITEMS = ("params", "train", "meta")


# Errors live with the digests (integrity.py); the names here are the API.
CheckpointError = integrity.CheckpointError
CorruptCheckpointError = integrity.CorruptCheckpointError


def make_manager(workdir: str, *, max_to_keep: int | None = None, async_save: bool = True,
                 read_only: bool = False) -> ocp.CheckpointManager:
  """Manager over `<workdir>/checkpoints`. async_save lets training run while the previous
  state is written (Orbax copies arrays to host before `save` returns, so donating the state
  to the next step is safe)."""
  root = os.path.join(os.path.abspath(workdir), "checkpoints")
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep or None, create=not read_only, read_only=read_only,
      enable_async_checkpointing=async_save,
      # Leftover temporary directories are saves interrupted by a kill: never valid.
      cleanup_tmp_directories=not read_only)
  return ocp.CheckpointManager(root, options=options, item_names=_ITEMS)


def make_meta(model_cfg: llama.LlamaConfig, tokenizer, config=None, **extra) -> dict:
  """The JSON metadata item saved with every checkpoint."""
  meta = {
      "format": FORMAT,
      "model": dataclasses.asdict(model_cfg),
      "tokenizer": {"name": getattr(tokenizer, "name", ""), "fingerprint": tokenizer.fingerprint,
                    "vocab_size": int(tokenizer.vocab_size)},
  }
  if config is not None:
    meta["config"] = json.loads(config.to_json_best_effort()) if hasattr(
        config, "to_json_best_effort") else config
  meta.update(extra)
  return meta


def save(manager: ocp.CheckpointManager, step: int, state, meta: dict, *,
         force: bool = True) -> None:
  """Save a TrainState (`.step`, `.params`, `.opt_state`) at `step` (asynchronously if the
  manager is async; `manager.wait_until_finished()` to block), with the digests of its arrays
  and meta in meta["integrity"] (computed on device first, which waits for the state)."""
  train = {"step": state.step, "opt_state": state.opt_state}
  meta = integrity.record({**meta, "step": int(step)}, {"params": state.params, "train": train})
  args = ocp.args.Composite(
      params=ocp.args.StandardSave(state.params),
      train=ocp.args.StandardSave(train),
      meta=ocp.args.JsonSave(meta))
  manager.save(int(step), args=args, force=force)


def _step_dir(manager: ocp.CheckpointManager, step: int) -> str:
  return os.path.join(str(manager.directory), str(step))


def _restore(manager: ocp.CheckpointManager, step: int, path: str, **items):
  """orbax's restore of the named items of `step` (folder `path`); files it cannot read raise
  `integrity.restore_error`, the one message a failed restore shows (`integrity.reading`)."""
  try:
    with integrity.reading(path):
      return manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # orbax/tensorstore raise assorted types on bad files
    raise integrity.restore_error(path, step, e) from e


def _restore_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  """The meta item of `step`, its own digest verified."""
  path = _step_dir(manager, step)
  meta = dict(_restore(manager, step, path, meta=ocp.args.JsonRestore())["meta"])
  integrity.verify(path, step, meta)
  return meta


def check_saved_settings(meta: dict, expected: dict, section: str, path: str) -> None:
  """Refuse a checkpoint whose meta records other settings than this run's: `expected` maps meta
  keys (e.g. "steering") to this run's values; only the sub-keys given are compared, and only
  where the checkpoint recorded them (an older checkpoint may lack a newer setting, e.g.
  steering_training.lr_scale). `section` is the config section the user sets them in, named in
  the error with the fix."""
  diffs = []
  for key, want in expected.items():
    saved = meta.get(key) or {}
    for name, value in json.loads(json.dumps(want)).items():
      if name in saved and saved[name] != value:
        diffs.append(f"{name}: saved {saved.get(name)!r}, this run {value!r}")
  if diffs:
    raise CheckpointError(
        f"Checkpoint {path} was trained with other `{section}` settings than this run asks for "
        f"({'; '.join(diffs)}), so it cannot be resumed. Fix: set {section}.* back to the saved "
        "values to resume it, or pass a new --workdir to train afresh.")


def restore_latest(workdir: str, abstract_state, *, model_cfg: llama.LlamaConfig | None = None,
                   manager: ocp.CheckpointManager | None = None,
                   expected: tuple[str, dict] | None = None,
                   skip_corrupt: bool = False, config=None) -> tuple[Any, dict] | None:
  """(state, meta) from the newest checkpoint in `<workdir>/checkpoints`, or None if there is
  none. `abstract_state` is a TrainState of `jax.ShapeDtypeStruct`s whose `.sharding`s say
  where each restored array goes (from `jax.eval_shape` + `parallel.param_shardings`).
  model_cfg: if given, checked against the checkpoint's before any array is read, so a workdir
  reused for another model fails with a clear message rather than a shape error.
  expected: (config section, {meta key: this run's values}) checked the same way
  (`check_saved_settings`), e.g. a steering module's layers and mode.
  A checkpoint whose params or optimizer state have other paths or shapes than `abstract_state`
  is refused before any array is read (`check_structure`), naming the fields where `config` (this
  run's) differs from the one saved with it: a setting changed on resume, not a corrupt file.
  Every array and the meta are verified against their recorded digests (none recorded: an older
  checkpoint, restored unverified). A corrupt newest step raises CorruptCheckpointError; with
  `skip_corrupt`, older steps are tried and, once one restores, the corrupt newer ones are moved
  to `<workdir>/checkpoints_corrupt/` with a warning naming each (if none restores, nothing moves
  and the newest one's error is raised: failing everywhere points at this run's settings, not at
  the files)."""
  own = manager is None
  manager = manager or make_manager(workdir, read_only=True)
  try:
    corrupt: list[CorruptCheckpointError] = []
    for step in sorted(manager.all_steps(), reverse=True):
      try:
        state, meta = _restore_step(manager, step, abstract_state, model_cfg, expected, config)
      except CorruptCheckpointError as e:
        if not skip_corrupt:
          raise
        corrupt.append(e)
        continue
      if corrupt:
        _set_aside(manager, corrupt, step)
      return state, meta
    if corrupt:
      raise corrupt[0]
    return None
  finally:
    if own:
      manager.close()


def _restore_step(manager: ocp.CheckpointManager, step: int, abstract_state, model_cfg,
                  expected, config=None) -> tuple[Any, dict]:
  path = _step_dir(manager, step)
  meta = _restore_meta(manager, step)
  if model_cfg is not None:
    check_model_config(model_config_from_meta(meta, path), model_cfg, path)
  if expected is not None:
    check_saved_settings(meta, expected[1], expected[0], path)
  check_structure(path, abstract_state, meta, config)
  restored = _restore(manager, step, path,
                      params=ocp.args.StandardRestore(abstract_state.params),
                      train=ocp.args.StandardRestore({"step": abstract_state.step,
                                                      "opt_state": abstract_state.opt_state}))
  integrity.verify(path, step, meta, {"params": restored["params"], "train": restored["train"]})
  train = restored["train"]
  state = abstract_state.replace(step=train["step"], params=restored["params"],
                                 opt_state=train["opt_state"])
  logging.info("Restored step %d from %s.", step, path)
  return state, meta


def _shapes(tree) -> dict[str, tuple]:
  """{"a/0/count": shape} for every array leaf of a state or of orbax's metadata of one: dict
  keys, sequence indices and NamedTuple fields alike are path parts (orbax saves a NamedTuple's
  fields as dict keys, and leaves empty states out, as jax's flattening does)."""
  def part(k):
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return {"/".join(part(k) for k in path): tuple(getattr(leaf, "shape", ()))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _first_difference(saved: dict, built: dict) -> str:
  for key, shape in built.items():
    if key not in saved:
      return f"this run builds {key} {list(shape)}, which the checkpoint lacks"
    if saved[key] != shape:
      return f"{key} is {list(saved[key])} there and {list(shape)} here"
  extra = next(k for k in saved if k not in built)
  return f"the checkpoint holds {extra} {list(saved[extra])}, which this run does not build"


def config_differences(saved: Any, now: Any, limit: int = 8) -> list[str]:
  """'field: saved X, this run Y' for every leaf where two configs (JSON dicts or ConfigDicts)
  differ, in the order of this run's config, at most `limit` of them (then a count)."""
  def flat(c, prefix=""):
    if hasattr(c, "to_json_best_effort"):
      c = json.loads(c.to_json_best_effort())
    if not isinstance(c, dict):
      return {prefix[:-1]: c}
    out = {}
    for k, v in c.items():
      out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k: v})
    return out
  a, b = flat(saved or {}), flat(now or {})
  missing = object()
  diffs = [f"{k}: saved {a.get(k, '(unset)')!r}, this run {b.get(k, '(unset)')!r}"
           for k in list(b) + [k for k in a if k not in b]
           if a.get(k, missing) != b.get(k, missing)]
  return diffs[:limit] + ([f"and {len(diffs) - limit} more"] if len(diffs) > limit else [])


def check_structure(path: str, abstract_state, meta: dict, config) -> None:
  """Raise CheckpointError when the step folder `path`'s params or optimizer state do not have the
  paths and shapes this run's `abstract_state` has (a setting that shapes the state, such as
  train.grad_clip or a module's layers, changed since the checkpoint was written); orbax would
  otherwise fail inside the restore, which reads like a corrupt file. Only metadata is read; a
  step whose metadata does not decode is left to the restore, which names it corrupt."""
  wrong = _structure_difference(path, {
      "params": abstract_state.params,
      "train": {"step": abstract_state.step, "opt_state": abstract_state.opt_state}})
  if wrong is None:
    return
  item, detail = wrong
  what = "model params" if item == "params" else "optimizer state"
  diffs = config_differences(meta.get("config"), config) if config is not None else []
  cause = (f"This run's config differs from the one saved with it in: {'; '.join(diffs)}. "
           "Fix: set back the one that shapes the state to resume (or resume with the spec_jax "
           "version that wrote it), or pass a new --workdir to train afresh."
           if diffs else
           "Fix: pass a new --workdir to train afresh, or resume with the settings and the "
           "spec_jax version that wrote it.")
  raise CheckpointError(
      f"Checkpoint {path} holds {what} of another structure than this run builds ({detail}), "
      f"so it cannot be resumed. {cause}")


def _structure_difference(path: str, built: dict[str, Any]) -> tuple[str, str] | None:
  """(item, its first difference) where the step folder's saved items (orbax's metadata) do not
  have the paths and shapes of `built` ({item: a tree of arrays or ShapeDtypeStructs}); None
  where they do, or where the metadata does not decode (the restore names that)."""
  try:  # read from the step folder: a read-only manager has no handlers to read items with
    handler = ocp.StandardCheckpointHandler()
    with integrity.reading(path):
      saved = {item: _shapes(handler.metadata(pathlib.Path(path) / item)) for item in built}
  except Exception:  # orbax raises assorted types on unreadable metadata
    return None
  for item, tree in built.items():
    want = _shapes(tree)
    if saved[item] and saved[item] != want:
      return item, _first_difference(saved[item], want)
  return None


def _set_aside(manager: ocp.CheckpointManager, corrupt: list[CorruptCheckpointError],
               resumed: int) -> None:
  """Move corrupt steps out of the manager's directory (a step left there would be saved over,
  or outlive the good steps under max_to_keep), into `<workdir>/checkpoints_corrupt/<step>`."""
  aside = os.path.join(os.path.dirname(str(manager.directory)), "checkpoints_corrupt")
  for e in corrupt:
    dest = os.path.join(aside, str(e.step))
    n = 1
    while os.path.exists(dest):
      dest, n = os.path.join(aside, f"{e.step}.{n}"), n + 1
    if jax.process_index() == 0:  # one shared directory: one process moves it
      os.makedirs(aside, exist_ok=True)
      shutil.move(e.path, dest)
    logging.warning(
        "Checkpoint %s (step %d) is corrupt: %s. Resuming from step %d, the newest intact "
        "checkpoint; the corrupt one was moved to %s.", e.path, e.step,
        f"array {e.what} ({e.detail})" if e.what else e.detail, resumed, dest)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    multihost_utils.sync_global_devices("spec_jax_corrupt_checkpoints_moved")
  manager.reload()


def resume_or_start(manager: ocp.CheckpointManager, abstract_state, fresh: Callable[[], Any], *,
                    num_steps: int, model_cfg: llama.LlamaConfig, tokenizer, writer,
                    config, expected: tuple[str, dict] | None = None) -> tuple[Any, int]:
  """Where a training run picks up: (state, step) of the newest intact checkpoint in `manager`'s
  directory (corrupt newer ones are set aside with a warning: `restore_latest`), its model and
  tokenizer checked and the metrics `writer` logged after it dropped; or, with no checkpoint,
  (fresh(), 0) and the run's hyper-parameters written. A returned step >= num_steps means the
  run is already finished (nothing is truncated then). `expected`: see restore_latest."""
  directory = str(manager.directory)
  restored = restore_latest(directory, abstract_state, model_cfg=model_cfg, manager=manager,
                            expected=expected, skip_corrupt=True, config=config)
  if restored is None:
    # A run killed before its first checkpoint left metrics of steps that will run again.
    writer.truncate_after(-1)
    writer.write_hparams(config)
    return fresh(), 0
  state, meta = restored
  check_tokenizer(meta, tokenizer, directory)
  start = int(jax.device_get(state.step))
  if start >= num_steps:
    logging.info("%s already holds step %d >= num_steps=%d: nothing to do.", directory, start,
                 num_steps)
    diffs = [d for d in config_differences(meta.get("config"), config)
             if not d.startswith("train.num_steps:")] if config is not None else []
    if diffs:
      logging.warning(
          "%s holds a finished run trained with another config (%s); it is read back as it is, "
          "not trained again. Fix: a new --workdir to train with this config.", directory,
          "; ".join(diffs))
  else:
    logging.info("Resuming from step %d.", start)
    writer.truncate_after(start)
  return state, start


def _resolve(path: str) -> tuple[str, int]:
  """A train_lm workdir, its `checkpoints/` folder, or one step folder -> (workdir, step)."""
  p = pathlib.Path(path).expanduser().absolute()
  if not p.exists():
    raise FileNotFoundError(
        f"No checkpoint at {p}: the path does not exist. Fix: pass a train_lm workdir (the "
        "--workdir of a training run), its checkpoints/ folder, or one checkpoints/<step> folder.")
  if (p / "meta").is_dir() or (p / "params").is_dir():  # a step folder
    if not p.name.isdigit():
      raise FileNotFoundError(f"{p} looks like a checkpoint step folder but is not named by its "
                              "step number (checkpoints/<step>).")
    return str(p.parent.parent), int(p.name)
  workdir = p.parent if p.name == "checkpoints" and not (p / "checkpoints").is_dir() else p
  steps = []
  root = workdir / "checkpoints"
  if root.is_dir():
    steps = sorted(int(d.name) for d in root.iterdir()
                   if d.name.isdigit() and (d / "_CHECKPOINT_METADATA").exists())
  if not steps:
    raise FileNotFoundError(
        f"No checkpoint found under {p} (looked for {root}/<step>/ folders). Fix: train one "
        f"first (`launch.py --config configs/train_lm.py --workdir {p}`) or pass the workdir "
        "of a finished run.")
  return str(workdir), steps[-1]


def model_config_from_meta(meta: dict, path: str = "") -> llama.LlamaConfig:
  saved = dict(meta.get("model", {}))
  family = saved.get("family", "llama")
  if family not in families.CONFIGS:
    raise CheckpointError(f"Checkpoint {path} holds a model of family {family!r}, which this "
                          f"version of spec_jax does not know ({', '.join(families.CONFIGS)}).")
  unknown = sorted(set(saved) - families.field_names(family))
  if not saved or unknown:
    raise CheckpointError(
        f"Checkpoint {path} has no usable model config in its meta (missing, or unknown fields "
        f"{unknown}); it was written by another version of spec_jax.")
  return families.config_from_dict(saved)


def check_model_config(saved: llama.LlamaConfig, requested: llama.LlamaConfig, path: str) -> None:
  """Raise CheckpointError listing every field where the checkpoint's model differs."""
  diffs = [f"{f.name}: checkpoint {getattr(saved, f.name)!r} vs requested "
           f"{getattr(requested, f.name)!r}"
           for f in dataclasses.fields(saved)
           if getattr(saved, f.name) != getattr(requested, f.name, None)]
  if diffs:
    raise CheckpointError(
        f"Checkpoint {path} holds a different model than requested ({'; '.join(diffs)}). Fix: "
        "use a fresh --workdir for a new model, or request the checkpoint's model (e.g. "
        "--config.model.size matching it), or load it without a requested config.")


def check_tokenizer(meta: dict, tokenizer, path: str) -> None:
  """Raise CheckpointError when a checkpoint was trained with another vocabulary."""
  saved = meta.get("tokenizer", {})
  # repr_fingerprint: the interpreter-dependent form a checkpoint may carry (data/tokenizer.py).
  if saved.get("fingerprint") not in (tokenizer.fingerprint, tokenizer.repr_fingerprint):
    raise CheckpointError(
        f"Checkpoint {path} was trained with tokenizer {saved.get('name')!r} (fingerprint "
        f"{saved.get('fingerprint')}, vocab {saved.get('vocab_size')}) but the requested "
        f"tokenizer is {getattr(tokenizer, 'name', '?')!r} (fingerprint {tokenizer.fingerprint}, "
        f"vocab {tokenizer.vocab_size}). Fix: set config.tokenizer to the checkpoint's.")


def steering_from_meta(meta: dict, path: str = "") -> steering.SteeringConfig | None:
  """The SD² steering module a checkpoint carries (saved by train_steering), or None."""
  saved = meta.get("steering")
  if not saved:
    return None
  try:
    return steering.SteeringConfig(**saved)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"Checkpoint {path} has an unusable steering config in its meta "
                          f"({e}); it was written by another version of spec_jax.") from e


def bpd_from_meta(meta: dict, path: str = "") -> bpd_heads.BPDConfig | None:
  """The BPD heads' config a checkpoint carries (saved by train_bpd), or None. Such a checkpoint
  holds the heads alone; its "model" is the verifier they were trained on."""
  saved = meta.get("bpd")
  if not saved:
    return None
  try:
    return bpd_heads.BPDConfig(**saved)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"Checkpoint {path} has an unusable bpd config in its meta ({e}); it "
                          "was written by another version of spec_jax.") from e


def identity(path: str) -> str:
  """What the checkpoint at `path` holds, from its meta alone (no array is read): a hash of its
  newest step and its meta, which records every array's digest, so training it further or
  again changes it. '' when `path` is not a spec_jax checkpoint (a packaged model's name, an HF
  directory, a GGUF file, nothing): those are named by their path alone."""
  if not path:
    return ""
  try:
    _, step = _resolve(path)
    meta = read_meta(path)
  except Exception:  # noqa: BLE001  (not a checkpoint here: the loader names what it is)
    return ""
  blob = json.dumps({"step": step, "meta": meta}, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_meta(path: str) -> dict:
  """The meta item of the newest checkpoint under `path` (see `load_model` for the paths)."""
  workdir, step = _resolve(path)
  manager = make_manager(workdir, read_only=True)
  try:
    return _restore_meta(manager, step)
  finally:
    manager.close()


def load_model(path: str, model_cfg: llama.LlamaConfig | None = None, *, shardings=None
               ) -> tuple[llama.LlamaConfig, Any, dict]:
  """(LlamaConfig, params, meta) of a trained model, without the optimizer state. A steered
  drafter (train_steering) comes as params {"drafter", "steering"}, its module's config in
  `steering_from_meta(meta)`; BPD heads (train_bpd) as the heads' params with the config of the
  verifier they sit on, their own config in `bpd_from_meta(meta)`.

  path: a train_lm workdir (newest checkpoint), its `checkpoints/` folder, or a specific
    `checkpoints/<step>` folder.
  model_cfg: if given, the checkpoint's model config must equal it (CheckpointError otherwise).
  shardings: pytree of Shardings for the params (default: this process's first device; on
    several hosts, each process restores its own copy).

  The params and meta are verified against the digests recorded when they were saved: a corrupt
  checkpoint is refused (CorruptCheckpointError: its path, step, array and the fix), never loaded
  silently. A checkpoint saved before digests existed loads unverified.
  """
  workdir, step = _resolve(path)
  manager = make_manager(workdir, read_only=True)
  step_path = _step_dir(manager, step)
  try:
    meta = _restore_meta(manager, step)
    cfg = model_config_from_meta(meta, step_path)
    if model_cfg is not None:
      check_model_config(cfg, model_cfg, step_path)
    shapes = llama.param_shapes(cfg)
    s_cfg = steering_from_meta(meta, step_path)
    if s_cfg is not None:  # a train_steering checkpoint: the drafter and its steering module
      shapes = {"drafter": shapes, "steering": steering.param_shapes(s_cfg)}
    b_cfg = bpd_from_meta(meta, step_path)
    if b_cfg is not None:  # a train_bpd checkpoint: the heads alone (cfg is their verifier's)
      shapes = jax.eval_shape(lambda: bpd_heads.init_params(
          dataclasses.replace(b_cfg, own_projection=False), jax.random.key(0)))
      if b_cfg.own_projection:
        shapes["out"] = jax.ShapeDtypeStruct((b_cfg.num_heads, b_cfg.d_model, b_cfg.vocab_size),
                                             "float32")
    if shardings is None:
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      shardings = jax.tree.map(lambda _: device, shapes)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)
    wrong = _structure_difference(step_path, {"params": abstract})
    if wrong is not None:
      raise CheckpointError(
          f"Checkpoint {step_path} holds params of another structure than its saved model config "
          f"builds in this version of spec_jax ({wrong[1]}): it was written by another version, "
          "not damaged. Fix: load it with the spec_jax version that wrote it (its meta's config "
          "names the run), or retrain with this one.")
    params = _restore(manager, step, step_path,
                      params=ocp.args.StandardRestore(abstract))["params"]
    integrity.verify(step_path, step, meta, {"params": params})
  finally:
    manager.close()
  return cfg, params, meta
