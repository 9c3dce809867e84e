"""The model families by name: the registry that turns a saved config back into its class."""

from __future__ import annotations

import dataclasses

from spec_jax.models import gemma, llama, presets

CONFIGS = {"llama": llama.LlamaConfig, "gemma": gemma.GemmaConfig}


def config_class(family: str):
  if family not in CONFIGS:
    raise ValueError(f"Unknown model family {family!r}; known: {', '.join(CONFIGS)}.")
  return CONFIGS[family]


def field_names(family: str) -> set[str]:
  return {f.name for f in dataclasses.fields(config_class(family))}


def config_from_dict(fields: dict) -> llama.LlamaConfig:
  """The config of a `dataclasses.asdict` dict (checkpoint meta); family defaults to llama."""
  return config_class(fields.get("family", "llama"))(**fields)


def variant_names() -> list[str]:
  return sorted([*llama.variant_names(), *gemma.VARIANTS, *presets.names()])


def model_config(name: str, **overrides) -> llama.LlamaConfig:
  """The named size variant of any family (`llama.model_config`'s, then Gemma's), with fields
  overridden (typically vocab_size, dtype), or an architecture preset (`presets.py`: a published
  shape, which keeps its own vocabulary; vocab_size is then the tokenizer's, which must fit)."""
  if name in presets.PRESETS:
    return presets.config(name, **overrides)
  if name in gemma.VARIANTS:
    return gemma.GemmaConfig(**{**gemma.VARIANTS[name], **overrides})
  check_size(name)
  return llama.model_config(name, **overrides)


def check_size(name: str, field: str = "the config's <model section>.size") -> str:
  """`name` if it is a size variant or a preset, else ValueError naming `field` and listing both."""
  if name not in variant_names():
    raise ValueError(
        f"Unknown model size {name!r} ({field}). Known variants: "
        f"{', '.join(sorted([*llama.variant_names(), *gemma.VARIANTS]))}; architecture presets: "
        f"{', '.join(presets.names())}.")
  return name
