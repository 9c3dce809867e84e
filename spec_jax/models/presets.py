"""Architecture presets: the published shapes of the models researchers run, as data, for speed
and memory work with random weights (`model.size=llama3.1-8b`, any dtype; τ needs real weights,
which an HF checkpoint directory brings: `model.checkpoint=hf:DIR`).

Each preset is the text decoder of the HF repository named beside it, written as the fields of
our config (`llama.LlamaConfig`, `gemma.GemmaConfig`): tests/test_presets.py checks that each one
equals what `hf_import.config_from_hf` makes of that repository's config.json, and that its
parameter count (`param_count`, from shapes alone) is the published size.

A preset keeps its published vocabulary: the output layer is part of the shape being measured.
A tokenizer with fewer tokens runs it (its ids index the embedding, as with an HF checkpoint
whose embedding is padded); one with more is refused (`config`).

Gemma 3 4B and 27B ship as multimodal checkpoints (model_type 'gemma3'); their presets are the
text decoder (`text_config`), without the vision tower, so their sizes are the text decoder's.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from spec_jax.models import decoder, gemma, llama

# Compute dtypes a preset runs in (float64 needs jax_enable_x64, which nothing here turns on).
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Preset:
  """One published architecture. fields: the config's fields (vocabulary included);
  params: its published parameter count (source in the comment beside it in PRESETS)."""
  hf_repo: str
  family: str
  fields: dict
  params: float


def _llama3_rope(factor: float) -> dict:
  """Llama 3.1/3.2's `rope_scaling` (rope_type 'llama3'), as our fields."""
  return dict(rope_theta=500_000.0, rope_scaling="llama3", rope_factor=factor,
              rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_positions=8192)


def _gemma3(n_layers: int, window: int, **fields) -> dict:
  """Gemma 3's text decoder: five sliding-window layers, then one global (sliding_window_pattern
  6), local RoPE base 10k, global 1M."""
  base = dict(vocab_size=262_208, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
              qk_norm=True, n_layers=n_layers, norm_eps=1e-6,
              layer_windows=tuple(0 if (i + 1) % 6 == 0 else window for i in range(n_layers)))
  return {**base, **fields}


_LLAMA = dict(norm_eps=1e-5, n_kv_heads=8, head_dim=128, vocab_size=128_256)
_QWEN3 = dict(norm_eps=1e-6, n_kv_heads=8, head_dim=128, vocab_size=151_936,
              rope_theta=1_000_000.0, qk_norm=True)

PRESETS = {
    # Published sizes: the model cards (Llama: "1.23B", "3.21B", "8.03B", "70.6B"; Qwen3: "0.6B",
    # "1.7B", "8.2B"); Gemma 3: the technical report's Table 1, embedding + non-embedding
    # parameters of the text decoder (1B: 302M + 698M; 4B: 675M + 3,209M; 27B: 1,416M + 25,600M).
    "llama3.2-1b": Preset("meta-llama/Llama-3.2-1B", "llama", dict(
        _LLAMA, d_model=2048, d_ff=8192, n_layers=16, n_heads=32, head_dim=64,
        tie_embeddings=True, **_llama3_rope(32.0)), 1.23e9),
    "llama3.2-3b": Preset("meta-llama/Llama-3.2-3B", "llama", dict(
        _LLAMA, d_model=3072, d_ff=8192, n_layers=28, n_heads=24, tie_embeddings=True,
        **_llama3_rope(32.0)), 3.21e9),
    "llama3.1-8b": Preset("meta-llama/Llama-3.1-8B", "llama", dict(
        _LLAMA, d_model=4096, d_ff=14336, n_layers=32, n_heads=32, tie_embeddings=False,
        **_llama3_rope(8.0)), 8.03e9),
    "llama3.1-70b": Preset("meta-llama/Llama-3.1-70B", "llama", dict(
        _LLAMA, d_model=8192, d_ff=28672, n_layers=80, n_heads=64, tie_embeddings=False,
        **_llama3_rope(8.0)), 70.6e9),
    "qwen3-0.6b": Preset("Qwen/Qwen3-0.6B", "llama", dict(
        _QWEN3, d_model=1024, d_ff=3072, n_layers=28, n_heads=16, tie_embeddings=True), 0.6e9),
    "qwen3-1.7b": Preset("Qwen/Qwen3-1.7B", "llama", dict(
        _QWEN3, d_model=2048, d_ff=6144, n_layers=28, n_heads=16, tie_embeddings=True), 1.7e9),
    "qwen3-8b": Preset("Qwen/Qwen3-8B", "llama", dict(
        _QWEN3, d_model=4096, d_ff=12288, n_layers=36, n_heads=32, tie_embeddings=False), 8.2e9),
    "gemma3-1b": Preset("google/gemma-3-1b-pt", "gemma", _gemma3(
        26, 512, vocab_size=262_144, d_model=1152, d_ff=6912, n_heads=4, n_kv_heads=1,
        head_dim=256, query_pre_attn_scalar=256.0), 1.000e9),
    "gemma3-4b": Preset("google/gemma-3-4b-pt", "gemma", _gemma3(
        34, 1024, d_model=2560, d_ff=10240, n_heads=8, n_kv_heads=4, head_dim=256,
        query_pre_attn_scalar=256.0, rope_scaling="linear", rope_factor=8.0), 3.884e9),
    "gemma3-27b": Preset("google/gemma-3-27b-pt", "gemma", _gemma3(
        62, 1024, d_model=5376, d_ff=21504, n_heads=32, n_kv_heads=16, head_dim=128,
        query_pre_attn_scalar=168.0, rope_scaling="linear", rope_factor=8.0), 27.016e9),
}

_CLASSES = {"llama": llama.LlamaConfig, "gemma": gemma.GemmaConfig}


def names() -> list[str]:
  return list(PRESETS)


def get(name: str, field: str = "model.size") -> Preset:
  """The preset called `name`; ValueError naming `field` and listing the presets."""
  if name not in PRESETS:
    raise ValueError(f"{field}={name!r} is not a preset; presets: {', '.join(PRESETS)}.")
  return PRESETS[name]


def check_dtype(dtype: str, field: str = "model.dtype") -> str:
  """`dtype` if the models run in it, else ValueError naming `field`."""
  if dtype not in DTYPES:
    raise ValueError(f"{field}={dtype!r} is not a dtype the models run in; choose one of "
                     f"{', '.join(DTYPES)} (bfloat16 on accelerators).")
  return dtype


def config(name: str, *, dtype: str = "float32", vocab_size: int | None = None,
           field: str = "model.size", **overrides) -> llama.LlamaConfig:
  """The config of preset `name` in `dtype` (compute, cache and weights). vocab_size: the
  tokenizer's vocabulary, which must fit in the preset's (module docstring); the preset keeps its
  own. overrides: any other fields (e.g. n_layers for a shallower model of the same width)."""
  preset = get(name, field)
  check_dtype(dtype, field.rpartition(".")[0] + ".dtype" if "." in field else "dtype")
  own = preset.fields["vocab_size"]
  if vocab_size is not None and vocab_size > own:
    raise ValueError(f"{field}={name!r} has a vocabulary of {own} tokens but the tokenizer has "
                     f"{vocab_size}: its ids would index past the embedding. Fix: the preset's "
                     "own tokenizer (config.tokenizer, an HF directory), or 'bytes' for speed "
                     "runs with random weights.")
  return _CLASSES[preset.family](**{**preset.fields, "dtype": dtype, "param_dtype": dtype,
                                    **overrides})


def param_count(cfg) -> int:
  """Parameters of a model config, from its shapes (`jax.eval_shape`: nothing is allocated)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(decoder.param_shapes(cfg)))


def param_bytes(cfg) -> int:
  """Bytes of a model's parameters in its param_dtype, from shapes alone."""
  return sum(math.prod(x.shape) * x.dtype.itemsize
             for x in jax.tree.leaves(decoder.param_shapes(cfg)))


def block_drafter(cfg, layers=None, field: str = "layers"):
  """The config of a feature drafter (EAGLE; `draft_init.feature_drafter`) made of `layers`
  blocks of `cfg` (default: the last one, as `<size>:layers=L-1:features=1` builds from a
  checkpoint), for shape work with random weights: the verifier's width, heads, vocabulary and
  per-layer windows, plus the fc over [features; embedding]. ValueError naming `field` for a
  block the verifier lacks."""
  layers = (cfg.n_layers - 1,) if layers is None else tuple(layers)
  if not layers or any(not 0 <= i < cfg.n_layers for i in layers):
    raise ValueError(f"{field}: a block drafter keeps 1..{cfg.n_layers} of the verifier's "
                     f"{cfg.n_layers} blocks, got layers {layers}. Fix: layers inside "
                     f"0..{cfg.n_layers - 1}.")
  windows = tuple(cfg.layer_windows[i] for i in layers) if cfg.layer_windows else ()
  return dataclasses.replace(cfg, n_layers=len(layers), layer_windows=windows,
                             feature_width=cfg.d_model)
