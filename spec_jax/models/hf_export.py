"""Write spec_jax params as a Hugging Face checkpoint directory that transformers loads.

  export_hf(out_dir, cfg, params, tokenizer) writes
    config.json             the family's architecture (`hf_model_type`): LlamaForCausalLM, Qwen2
                            (q/k/v bias), Qwen3 (q/k norm), Mistral (one sliding window), Gemma2,
                            Gemma3ForCausalLM
    model.safetensors       float32 (or the params' dtype, or `dtype`)
    generation_config.json  bos/eos/pad ids; eos_token_id lists every stop id of the tokenizer
    tokenizer.json, tokenizer_config.json   when the tokenizer is an HF tokenizer
  and `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` computes the same logits.

The tensor layout is the inverse of `hf_import.layer_tensors` (transposes and reshapes only), so
export -> `hf_import.read_hf` gives back the same params bit for bit.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np

from spec_jax.models import hf_import, llama
from spec_jax.models import layers as L

GEMMA_TYPES = hf_import.GEMMA_TYPES
_SAFETENSORS_NAMES = {np.dtype(v): k for k, v in hf_import.SAFETENSORS_DTYPES.items()}


def write_safetensors(path: str | pathlib.Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
  """Write tensors (C order, little endian) in the safetensors format: u64 header length, JSON
  header padded with spaces to 8 bytes (so every buffer stays aligned), then the raw buffers."""
  if sys.byteorder != "little":
    raise NotImplementedError("safetensors is little endian; writing from a big-endian host "
                              "is not implemented.")
  header, offset = {}, 0
  for name, arr in tensors.items():
    dtype = np.dtype(arr.dtype)
    if dtype not in _SAFETENSORS_NAMES:
      raise ValueError(f"Tensor {name!r} has dtype {dtype}, which safetensors cannot store here.")
    header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  header["__metadata__"] = metadata or {"format": "pt"}  # transformers requires format "pt"
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for arr in tensors.values():
      f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)


def params_to_hf(cfg: llama.LlamaConfig, params, dtype: str | None = None) -> dict[str, np.ndarray]:
  """HF tensor name -> numpy array, in transformers' layout. dtype: cast to it (default: keep)."""
  if cfg.head_ids:
    raise ValueError(
        f"This model drafts from a reduced vocabulary ({len(cfg.head_ids)} of {cfg.vocab_size} "
        "tokens, draft_init.reduce_vocab), which transformers' configs cannot express: export "
        "a full-vocabulary drafter instead.")
  if cfg.feature_width:
    raise ValueError(
        "This model is a feature drafter (EAGLE: it reads the verifier's final residual beside "
        "each token, draft_init.feature_drafter), which transformers' Llama cannot run: export "
        "a language-model drafter instead.")
  if cfg.unrolled:
    params = L.stack_layers(params, cfg.n_layers)
  if cfg.out_major:
    params = L.out_minor_params(params)
  host = jax.device_get(L.unfuse_params(params, cfg) if cfg.fused else params)
  cast = (lambda w: np.asarray(w)) if dtype is None else (  # noqa: E731
      lambda w: np.asarray(w).astype(hf_import.np_dtype_of(dtype)))
  out = {"model.embed_tokens.weight": cast(host["embed"]["embedding"])}
  layers = host["layers"]
  for i in range(cfg.n_layers):
    for suffix, where, shape, _, to_hf in hf_import.layer_tensors(cfg):
      w = layers
      for key in where:
        w = w[key]
      out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(cast(to_hf(np.asarray(w[i]))))
  out["model.norm.weight"] = cast(host["final_norm"]["scale"])
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(cast(host["lm_head"]["kernel"]).T)
  want = hf_import.expected_tensors(cfg)
  for name, arr in out.items():  # params that do not belong to cfg would export garbage
    if tuple(arr.shape) != want[name]:
      raise ValueError(f"params do not match the model config: {name} would have shape "
                       f"{tuple(arr.shape)}, expected {want[name]}.")
  return out


def hf_model_type(cfg: llama.LlamaConfig) -> str:
  """The transformers model_type that computes what `cfg` computes."""
  if cfg.family == "gemma":
    return "gemma3_text" if cfg.qk_norm else "gemma2"
  if cfg.qk_norm:
    return "qwen3"
  if cfg.qkv_bias:
    return "qwen2"
  if cfg.has_windows:
    if len(set(cfg.layer_windows)) != 1:
      raise ValueError(f"layer_windows={cfg.layer_windows}: a Llama without q/k norm or biases "
                       "exports as Mistral, whose sliding window covers every layer alike.")
    return "mistral"
  return "llama"


def _number(x: float) -> int | float:
  """An int where the value is integral (transformers' strict configs type some fields int)."""
  return int(x) if float(x).is_integer() else x


def _rope_scaling(cfg: llama.LlamaConfig) -> dict | None:
  if cfg.rope_scaling == "linear":
    return {"rope_type": "linear", "factor": cfg.rope_factor}
  if cfg.rope_scaling == "llama3":
    return {"rope_type": "llama3", "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions}
  return None


def config_to_hf(cfg: llama.LlamaConfig, *, dtype: str = "float32",
                 max_position_embeddings: int = 8192, bos_token_id: int | None = None,
                 eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None) -> dict:
  """config.json for `cfg`. Written in the transformers 4 style (rope_theta, rope_scaling,
  torch_dtype), which transformers 5 also reads.

  max_position_embeddings: the context length the checkpoint advertises. With the default RoPE it
    changes no logit; it bounds transformers' generation length (SmolLM2: 8192).
  """
  model_type = hf_model_type(cfg)
  hf = {
      "architectures": [hf_import.ARCHITECTURES[model_type]], "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim, "max_position_embeddings": max_position_embeddings,
      "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
      "rope_scaling": _rope_scaling(cfg), "tie_word_embeddings": cfg.tie_embeddings,
      "torch_dtype": dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
      "pad_token_id": pad_token_id, "initializer_range": 0.02, "attention_dropout": 0.0,
      "use_cache": True, "attention_bias": False,
  }
  types = ["sliding_attention" if w else "full_attention" for w in cfg.windows()]
  window = max(cfg.windows()) or None
  if window and len({w for w in cfg.windows() if w}) != 1:
    raise ValueError(f"layer_windows={cfg.layer_windows}: transformers has one sliding_window "
                     "per model; these layers use several.")
  if model_type in GEMMA_TYPES:
    hf.update(hidden_activation="gelu_pytorch_tanh", layer_types=types,
              sliding_window=window or max_position_embeddings,
              query_pre_attn_scalar=_number(cfg.query_pre_attn_scalar or cfg.head_dim),
              final_logit_softcapping=cfg.final_logit_softcap or None,
              attn_logit_softcapping=cfg.attn_logit_softcap or None)
    if model_type == "gemma3_text":
      local = cfg.rope_local_theta or cfg.rope_theta
      hf.update(rope_local_base_freq=local)
    return hf
  hf.update(hidden_act="silu")
  if model_type in ("qwen2", "qwen3"):
    hf.pop("attention_bias")
    first_window = next((i for i, w in enumerate(cfg.windows()) if w), cfg.n_layers)
    if window and any(not w for w in cfg.windows()[first_window:]):
      raise ValueError(f"layer_windows={cfg.layer_windows}: Qwen puts the sliding window on "
                       "every layer from max_window_layers on, not on these.")
    hf.update(use_sliding_window=bool(window), sliding_window=window,
              max_window_layers=first_window, layer_types=types)
    if model_type == "qwen3":
      hf.update(attention_bias=False)
  elif model_type == "mistral":
    hf.update(sliding_window=window)
  else:
    hf.update(mlp_bias=False, pretraining_tp=1)
  return hf


def export_hf(out_dir: str | pathlib.Path, cfg: llama.LlamaConfig, params, tokenizer=None, *,
              dtype: str | None = None, max_position_embeddings: int = 8192,
              extra_metadata: dict | None = None) -> pathlib.Path:
  """Write an HF checkpoint directory for (cfg, params); returns its path.

  tokenizer: an `HFTokenizer` (its files are written and its eos/stop ids go to the configs), any
    other tokenizer (ids only, no tokenizer files), or None.
  dtype: tensor dtype in the file ("float32", "bfloat16", "float16"); default: cfg.param_dtype.
  extra_metadata: strings stored in the safetensors header (e.g. where the weights came from).
  """
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  dtype = dtype or cfg.param_dtype
  if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"The tokenizer has {tokenizer.vocab_size} tokens but the model only "
                     f"{cfg.vocab_size}: export the tokenizer the model was trained with.")
  tensors = params_to_hf(cfg, params, dtype)
  stops = list(getattr(tokenizer, "stop_ids", ()))
  ids = dict(
      eos_token_id=(stops if len(stops) > 1 else stops[0]) if stops else None,
      pad_token_id=getattr(tokenizer, "pad_id", None),
      bos_token_id=(tokenizer.backend.token_to_id(tokenizer.bos_token)
                    if getattr(tokenizer, "bos_token", None) else None))
  # Stale shards of an earlier export would make the directory ambiguous to loaders.
  for stale in [*out.glob("model-*-of-*.safetensors"), out / hf_import.INDEX_FILE]:
    stale.unlink(missing_ok=True)
  metadata = {"format": "pt", "exported_by": "spec_jax", **(extra_metadata or {})}
  write_safetensors(out / hf_import.SINGLE_FILE, tensors, {k: str(v) for k, v in metadata.items()})
  config = config_to_hf(cfg, dtype=dtype, max_position_embeddings=max_position_embeddings, **ids)
  (out / "config.json").write_text(json.dumps(config, indent=2))
  generation = {k: v for k, v in ids.items() if v is not None}
  (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
  if hasattr(tokenizer, "save_hf"):
    tokenizer.save_hf(out)  # after generation_config.json, which it then leaves alone
  return out
