"""The model families by name: the registry that turns a saved config back into its class."""

from __future__ import annotations

import dataclasses

from spec_jax.models import gemma, llama

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
  return sorted([*llama.variant_names(), *gemma.VARIANTS])


def model_config(name: str, **overrides) -> llama.LlamaConfig:
  """The named size variant of any family (`llama.model_config`'s, then Gemma's), with fields
  overridden (typically vocab_size, dtype)."""
  if name in gemma.VARIANTS:
    return gemma.GemmaConfig(**{**gemma.VARIANTS[name], **overrides})
  if name not in llama.variant_names():
    raise ValueError(f"Unknown model size {name!r}. Known variants: {', '.join(variant_names())}.")
  return llama.model_config(name, **overrides)
