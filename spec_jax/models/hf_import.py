"""Read Hugging Face checkpoints (config.json + safetensors) into spec_jax params.

Supported `model_type`s (ARCHITECTURES): `llama` (Llama 2, Llama 3.x with `llama3` or `linear`
RoPE scaling, TinyLlama, SmolLM/SmolLM2), `mistral`, `qwen2` (q/k/v bias), `qwen3` (q/k norm,
head_dim independent of the width), `gemma2` (soft-capping) and `gemma3_text` (Gemma 3's text
decoder: q/k norm, local/global layers with two RoPE bases); sliding windows in every family.
Anything the forward does not compute -- other RoPE scalings (yarn, dynamic, longrope), a bias on
o_proj or the MLP, another activation, the multimodal `gemma3` wrapper, quantized weights -- is
refused with an error naming the config field, never loaded into silently wrong logits.

Weight layout. HF `nn.Linear` weights are [out, in]; our kernels are [in, out...], stacked over
layers on a leading L axis (shape legend of `llama.py`):
  q_proj.weight [N*H, D] -> attn.q.kernel [D, N, H]   (k, v likewise with K heads)
  o_proj.weight [D, N*H] -> attn.o.kernel [N, H, D]
  gate/up_proj.weight [F, D] -> [D, F];  down_proj.weight [D, F] -> [F, D]
  lm_head.weight [V, D] -> lm_head.kernel [D, V];  embed_tokens, norms: as they are.
HF Llama rotates halves in RoPE, as we do, so q/k need no permutation (unlike GGUF). Every step is
a transpose or a reshape, so export -> import is bitwise exact (`hf_export.py` is the inverse).

Safetensors is read with numpy alone (an 8-byte header length, a JSON header, raw buffers),
memory-mapped so a sharded multi-GB checkpoint is never read twice.
"""

from __future__ import annotations

import json
import pathlib
import struct
import ml_dtypes
import numpy as np

from spec_jax.models import gemma, llama

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
GEMMA_TYPES = ("gemma2", "gemma3_text")
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved beside the weights; recomputed by every forward.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFCheckpointError(ValueError):
  """An HF checkpoint that cannot be loaded exactly (unsupported, incomplete or inconsistent)."""


def np_dtype_of(name: str) -> np.dtype:
  """numpy dtype of a config dtype name ("float32", "bfloat16", ...)."""
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# ---------------------------------------------------------------------------------------------
# safetensors

def read_safetensors_header(path: pathlib.Path) -> tuple[dict, int]:
  """(header without __metadata__, byte offset of the data section)."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    raw = f.read(8)
    n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
    if not 0 < n <= size - 8:
      raise HFCheckpointError(f"{path} is not a safetensors file (bad header length); it is "
                              "truncated or corrupt. Re-download or re-export it.")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise HFCheckpointError(f"{path}: unreadable safetensors header ({e}).") from None
  header.pop("__metadata__", None)
  for name, info in header.items():
    begin, end = info["data_offsets"]
    if end > size - 8 - n:
      raise HFCheckpointError(f"{path}: tensor {name!r} ends at byte {end} of the data section but "
                              f"the file holds only {size - 8 - n}: the file is truncated.")
    if info["dtype"] not in SAFETENSORS_DTYPES:
      raise HFCheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which is not "
                              f"supported (supported: {', '.join(SAFETENSORS_DTYPES)}).")
  return header, 8 + n


def read_safetensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
  """All tensors of one file as read-only numpy arrays (memory-mapped, not copied)."""
  path = pathlib.Path(path)
  header, start = read_safetensors_header(path)
  data = np.memmap(path, np.uint8, mode="r", offset=start) if path.stat().st_size > start else (
      np.zeros(0, np.uint8))
  out = {}
  for name, info in header.items():
    begin, end = info["data_offsets"]
    out[name] = data[begin:end].view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


# ---------------------------------------------------------------------------------------------
# config.json -> LlamaConfig / GemmaConfig

_REFUSED_ROPE = ("yarn", "dynamic", "longrope", "proportional")


def _rope_spec(spec: dict, field: str, source: str) -> dict:
  """LlamaConfig RoPE fields of one rope_scaling / rope_parameters dict."""
  kind = spec.get("rope_type", spec.get("type", "default"))
  factor = spec.get("partial_rotary_factor", 1.0)
  if factor != 1.0:
    raise HFCheckpointError(f"{source}: {field}.partial_rotary_factor={factor} is not "
                            "implemented (spec_jax rotates the whole head).")
  if kind == "default":
    return {}
  if kind == "linear":
    return dict(rope_scaling="linear", rope_factor=float(spec["factor"]))
  if kind == "llama3":
    return dict(rope_scaling="llama3", rope_factor=float(spec["factor"]),
                rope_low_freq_factor=float(spec["low_freq_factor"]),
                rope_high_freq_factor=float(spec["high_freq_factor"]),
                rope_original_max_positions=int(spec["original_max_position_embeddings"]))
  raise HFCheckpointError(
      f"{source}: {field}.rope_type={kind!r} is not implemented; spec_jax supports RoPE types "
      f"'default', 'linear' and 'llama3' ({', '.join(map(repr, _REFUSED_ROPE))} are refused). "
      "Loading it would give wrong logits.")


def _rope(hf: dict, source: str, local: bool) -> dict:
  """RoPE fields from either config style: transformers < 5 (`rope_theta`, `rope_scaling`,
  Gemma 3's `rope_local_base_freq`) or >= 5 (`rope_parameters`, for Gemma keyed by layer type)."""
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise HFCheckpointError(f"{source}: partial_rotary_factor={hf['partial_rotary_factor']} is "
                            "not implemented (spec_jax rotates the whole head).")
  params = hf.get("rope_parameters") or {}
  out = {}
  if "full_attention" in params or "sliding_attention" in params:  # per layer type (Gemma 3)
    full = params.get("full_attention") or {}
    sliding = params.get("sliding_attention") or {}
    if _rope_spec(sliding, "rope_parameters.sliding_attention", source):
      raise HFCheckpointError(f"{source}: RoPE scaling on sliding-window layers is not "
                              "implemented (only on the global layers, as Gemma 3 uses it).")
    out.update(_rope_spec(full, "rope_parameters.full_attention", source))
    theta = full.get("rope_theta", hf.get("rope_theta", 10_000.0))
    if local:
      out["rope_local_theta"] = float(sliding.get("rope_theta",
                                                  hf.get("rope_local_base_freq", 10_000.0)))
  else:
    scaling = hf.get("rope_scaling") or {}
    out.update(_rope_spec(params, "rope_parameters", source) or
               _rope_spec(scaling, "rope_scaling", source))
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    if local and "rope_local_base_freq" in hf:
      out["rope_local_theta"] = float(hf["rope_local_base_freq"])
  out["rope_theta"] = float(theta)
  return out


def _layer_types(hf: dict, n_layers: int) -> list[str]:
  """Per-layer attention type ("full_attention" / "sliding_attention") as transformers derives
  it when config.json does not list `layer_types`."""
  if hf.get("layer_types"):
    return list(hf["layer_types"])
  model_type = hf["model_type"]
  window = hf.get("sliding_window")
  if model_type == "gemma2":
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
  if model_type == "gemma3_text":
    pattern = int(hf.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(n_layers)]
  if model_type in ("qwen2", "qwen3"):
    use = hf.get("use_sliding_window", False) and window is not None
    first = int(hf.get("max_window_layers", n_layers))
    return ["sliding_attention" if use and i >= first else "full_attention"
            for i in range(n_layers)]
  if model_type == "mistral" and window is not None:
    return ["sliding_attention"] * n_layers
  return ["full_attention"] * n_layers


def _windows(hf: dict, n_layers: int, source: str) -> tuple[int, ...]:
  types = _layer_types(hf, n_layers)
  if len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
    raise HFCheckpointError(f"{source}: layer_types={types} must name 'full_attention' or "
                            f"'sliding_attention' for each of the {n_layers} layers.")
  if "sliding_attention" not in types:
    return ()
  window = hf.get("sliding_window")
  if not window or int(window) < 1:
    raise HFCheckpointError(f"{source}: layer_types has sliding-window layers but "
                            f"sliding_window={window!r}.")
  if hf.get("use_bidirectional_attention"):
    raise HFCheckpointError(f"{source}: use_bidirectional_attention=true (an encoder) is not "
                            "a causal decoder; spec_jax decodes causal LMs only.")
  return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


# Keys of a Gemma config.json whose absence transformers fills with its config class's defaults
# (query scale 256, Gemma 2's soft-caps 50 / 30, Gemma 3's local RoPE base 1e4): refused when
# missing rather than read with other fallbacks.
_GEMMA_STATED = {"gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping",
                            "final_logit_softcapping"),
                 "gemma3_text": ("query_pre_attn_scalar", "rope_local_base_freq")}


def config_from_hf(hf: dict, *, dtype: str = "float32",
                   source: str = "config.json") -> llama.LlamaConfig:
  """The model config of an HF config.json dict (`gemma.GemmaConfig` for Gemma 2/3,
  `llama.LlamaConfig` otherwise); HFCheckpointError for anything unsupported."""
  model_type = hf.get("model_type")
  if model_type == "gemma3":
    raise HFCheckpointError(
        f"{source}: model_type='gemma3' is the multimodal Gemma3ForConditionalGeneration; "
        "spec_jax reads the text decoder only (model_type 'gemma3_text', Gemma3ForCausalLM, as "
        "google/gemma-3-1b-it and gemma-3-270m ship).")
  if model_type not in ARCHITECTURES:
    raise HFCheckpointError(
        f"{source}: model_type={model_type!r} is not supported. Supported: "
        f"{', '.join(f'{k} ({v})' for k, v in ARCHITECTURES.items())}; SmolLM/SmolLM2 and "
        "TinyLlama are model_type 'llama'.")
  if hf.get("architectures") and hf["architectures"][0] != ARCHITECTURES[model_type]:
    raise HFCheckpointError(f"{source}: architectures={hf['architectures']} is not a causal LM; "
                            f"expected {ARCHITECTURES[model_type]}.")
  missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads") if hf.get(k) is None]
  if missing:
    raise HFCheckpointError(f"{source} is missing {missing}; cannot build the model.")
  is_gemma = model_type in GEMMA_TYPES
  unstated = [k for k in _GEMMA_STATED.get(model_type, ()) if k not in hf and not (
      k == "rope_local_base_freq" and "sliding_attention" in (hf.get("rope_parameters") or {}))]
  if unstated:
    raise HFCheckpointError(
        f"{source} does not state {unstated}: transformers would take its {model_type} config "
        "class's defaults for them, which this import does not guess. Fix: write them into "
        "config.json (save_pretrained does; the model's published config.json has them).")
  act_field = "hidden_activation" if is_gemma and "hidden_activation" in hf else "hidden_act"
  act = hf.get(act_field, "gelu_pytorch_tanh" if is_gemma else "silu")
  want_act = ("gelu_pytorch_tanh", "gelu_tanh") if is_gemma else ("silu",)
  if act not in want_act:
    raise HFCheckpointError(f"{source}: {act_field}={act!r} is not implemented for {model_type} "
                            f"(only {' / '.join(want_act)}).")
  if hf.get("mlp_bias"):
    raise HFCheckpointError(f"{source}: mlp_bias=true is not implemented (MLP without biases).")
  if model_type != "qwen2" and hf.get("attention_bias"):
    raise HFCheckpointError(
        f"{source}: attention_bias=true gives {model_type}'s o_proj a bias, which spec_jax does "
        "not have (it supports q/k/v biases only, as in Qwen2).")
  if hf.get("quantization_config"):
    raise HFCheckpointError(f"{source}: quantized checkpoints (quantization_config) are not "
                            "supported; use float32/bfloat16/float16 safetensors weights.")
  n_heads = int(hf["num_attention_heads"])
  d_model = int(hf["hidden_size"])
  n_layers = int(hf["num_hidden_layers"])
  fields = dict(
      vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=n_layers,
      n_heads=n_heads, n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
      head_dim=int(hf.get("head_dim") or d_model // n_heads), d_ff=int(hf["intermediate_size"]),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=model_type == "qwen2", qk_norm=model_type in ("qwen3", "gemma3_text"),
      layer_windows=_windows(hf, n_layers, source), dtype=dtype, param_dtype=dtype,
      **_rope(hf, source, local=model_type == "gemma3_text"))
  if not is_gemma:
    return llama.LlamaConfig(tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **fields)
  return gemma.GemmaConfig(
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
      # Gemma 3's modelling ignores attn_logit_softcapping (it never reaches the attention).
      attn_logit_softcap=float(hf.get("attn_logit_softcapping") or 0.0)
      if model_type == "gemma2" else 0.0,
      final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0), **fields)


# ---------------------------------------------------------------------------------------------
# Tensor names and layouts

def layer_tensors(cfg: llama.LlamaConfig):
  """(HF name suffix inside `model.layers.{i}.`, our path under params['layers'], HF shape,
  HF array -> ours, ours -> HF) for every per-layer tensor of `cfg` (shapes of one layer)."""
  d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
  n, k = cfg.n_heads, cfg.n_kv_heads
  for name, heads in (("q", n), ("k", k), ("v", k)):
    yield (f"self_attn.{name}_proj.weight", ("attn", name, "kernel"), (heads * hd, d),
           lambda w, heads=heads: w.T.reshape(d, heads, hd),
           lambda w, heads=heads: w.reshape(d, heads * hd).T)
    if cfg.qkv_bias:
      yield (f"self_attn.{name}_proj.bias", ("attn", name, "bias"), (heads * hd,),
             lambda b, heads=heads: b.reshape(heads, hd), lambda b: b.reshape(-1))
  yield ("self_attn.o_proj.weight", ("attn", "o", "kernel"), (d, n * hd),
         lambda w: w.T.reshape(n, hd, d), lambda w: w.reshape(n * hd, d).T)
  for name, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
    yield f"mlp.{name}_proj.weight", (name, "kernel"), shape, lambda w: w.T, lambda w: w.T
  identity = lambda w: w  # noqa: E731
  if cfg.qk_norm:
    yield "self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (hd,), identity, identity
    yield "self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (hd,), identity, identity
  yield "input_layernorm.weight", ("attn_norm", "scale"), (d,), identity, identity
  if cfg.family == "gemma":  # four norms; Gemma's post_attention_layernorm follows the attention
    yield "post_attention_layernorm.weight", ("post_attn_norm", "scale"), (d,), identity, identity
    yield "pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), (d,), identity, identity
    yield "post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), (d,), identity, identity
  else:
    yield "post_attention_layernorm.weight", ("mlp_norm", "scale"), (d,), identity, identity


def expected_tensors(cfg: llama.LlamaConfig) -> dict[str, tuple]:
  """Every HF tensor name a checkpoint of `cfg` must hold, with its shape."""
  out = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.d_model),
         "model.norm.weight": (cfg.d_model,)}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
  for i in range(cfg.n_layers):
    for suffix, _, shape, _, _ in layer_tensors(cfg):
      out[f"model.layers.{i}.{suffix}"] = shape
  return out


# ---------------------------------------------------------------------------------------------
# Checkpoint directories

def is_hf_checkpoint(path: str | pathlib.Path) -> bool:
  """Whether `path` is an HF model directory: a config.json with a `model_type` (the weights are
  checked when read, so a directory with only pytorch_model.bin gets a clear error, not a miss)."""
  config = pathlib.Path(path) / "config.json"
  if not config.is_file():
    return False
  try:
    return "model_type" in json.loads(config.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError):
    return False


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """HF tensor name -> the file that holds it, checked against the files' own headers."""
  if (path / SINGLE_FILE).is_file():
    header, _ = read_safetensors_header(path / SINGLE_FILE)
    return {name: path / SINGLE_FILE for name in header}
  if not (path / INDEX_FILE).is_file():
    found = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = (f" It has {found}: only safetensors is read (pickled torch files can run code). "
            "Convert with transformers: model.save_pretrained(dir, safe_serialization=True).")
    raise HFCheckpointError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}." +
                            (hint if found else ""))
  try:
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise HFCheckpointError(f"{path / INDEX_FILE} is not a valid shard index ({e!r}).") from None
  by_file: dict[str, list[str]] = {}
  for name, file in weight_map.items():
    by_file.setdefault(file, []).append(name)
  missing = {f: names for f, names in by_file.items() if not (path / f).is_file()}
  if missing:
    detail = "; ".join(f"{f} (holds {len(n)} tensors, e.g. {sorted(n)[0]!r})"
                       for f, n in sorted(missing.items()))
    raise HFCheckpointError(f"{path}: shard files named by {INDEX_FILE} are missing: {detail}. "
                            "Copy the complete checkpoint (every model-*-of-*.safetensors).")
  files = {}
  for file, names in sorted(by_file.items()):
    header, _ = read_safetensors_header(path / file)
    absent = sorted(set(names) - set(header))
    if absent:
      raise HFCheckpointError(
          f"{path}: {INDEX_FILE} maps tensor {absent[0]!r} (and {len(absent) - 1} more) to "
          f"{file}, but {file} does not contain it: the shards do not belong to this index "
          "(mixed checkpoints or an interrupted copy).")
    files.update({name: path / file for name in names})
  return files


def read_config(path: str | pathlib.Path) -> dict:
  p = pathlib.Path(path)
  if not p.is_dir():
    raise FileNotFoundError(f"HF checkpoint directory not found: {p}")
  if not (p / "config.json").is_file():
    raise HFCheckpointError(f"{p} has no config.json; it is not an HF checkpoint directory.")
  return json.loads((p / "config.json").read_text())


def read_hf(path: str | pathlib.Path, *,
            dtype: str = "float32") -> tuple[llama.LlamaConfig, dict]:
  """Load an HF Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3 checkpoint directory: (LlamaConfig, params as numpy arrays
  of `dtype`). Sharded checkpoints are read through model.safetensors.index.json.

  Raises HFCheckpointError naming the field, tensor or file for unsupported configs, missing or
  mismatched shards, missing, unexpected or wrongly shaped tensors.
  """
  path = pathlib.Path(path)
  cfg = config_from_hf(read_config(path), dtype=dtype, source=str(path / "config.json"))
  files = _tensor_files(path)
  want = expected_tensors(cfg)
  missing = sorted(set(want) - set(files))
  if missing:
    raise HFCheckpointError(
        f"{path}: tensor {missing[0]!r} (and {len(missing) - 1} more) is missing from "
        f"{sorted({f.name for f in files.values()})}; the checkpoint does not match its "
        "config.json (e.g. tie_word_embeddings, num_hidden_layers or model_type).")
  ignorable = lambda name: name.endswith(_IGNORED_SUFFIXES) or (  # noqa: E731
      cfg.tie_embeddings and name == "lm_head.weight")  # tied: HF ignores a saved lm_head too
  extra = sorted(n for n in set(files) - set(want) if not ignorable(n))
  if extra:
    raise HFCheckpointError(
        f"{path}: unexpected tensor {extra[0]!r} in {files[extra[0]].name} (and {len(extra) - 1} "
        "more); spec_jax would ignore it and compute different logits than transformers.")
  opened: dict[pathlib.Path, dict[str, np.ndarray]] = {}

  def get(name: str) -> np.ndarray:
    file = files[name]
    if file not in opened:
      opened[file] = read_safetensors(file)
    w = opened[file][name]
    if tuple(w.shape) != want[name]:
      raise HFCheckpointError(f"{file}: tensor {name!r} has shape {tuple(w.shape)}, but "
                              f"config.json implies {want[name]}.")
    return w

  np_dtype = np_dtype_of(dtype)
  cast = lambda w: np.ascontiguousarray(w.astype(np_dtype))  # noqa: E731
  layers: dict = {}
  for suffix, where, _, to_ours, _ in layer_tensors(cfg):
    stacked = np.stack([to_ours(get(f"model.layers.{i}.{suffix}")) for i in range(cfg.n_layers)])
    node = layers
    for key in where[:-1]:
      node = node.setdefault(key, {})
    node[where[-1]] = cast(stacked)
  params = {"embed": {"embedding": cast(get("model.embed_tokens.weight"))}, "layers": layers,
            "final_norm": {"scale": cast(get("model.norm.weight"))}}
  if not cfg.tie_embeddings:
    params["lm_head"] = {"kernel": cast(get("lm_head.weight").T)}
  return cfg, params
