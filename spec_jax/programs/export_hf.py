"""Program `export_hf`: write a spec_jax model as a Hugging Face checkpoint directory.

The source is any `config.model.checkpoint` that `loading.resolve_model` reads: a train_lm
workdir (e.g. a distilled drafter), 'smollm2' (the GGUF, dequantized to float32), a .gguf path, an
HF directory, or '' (random init of `config.model.size`, for tests). The workdir becomes the HF
directory: config.json, model.safetensors, generation_config.json and, for HF tokenizers,
tokenizer.json + tokenizer_config.json (with the chat template). It is loaded back with
`hf_import.read_hf` and compared bit for bit before the program reports success, so a directory
this program wrote is one transformers and spec_jax both read as the same model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from spec_jax import checks, loading
from spec_jax.data import tokenizer as tokenizer_lib
from spec_jax.models import hf_export, hf_import, presets


def export_model(model_cfg, tokenizer, out_dir: str, *, seed: int = 0, dtype: str = "",
                 max_position_embeddings: int = 8192, field: str = "model.checkpoint") -> dict:
  """Export one `configs.common.model()` section to `out_dir` and verify the round trip.
  Returns a summary (source, model config, files, sizes, seconds)."""
  t0 = time.perf_counter()
  cfg, params = loading.load_model(model_cfg, tokenizer, seed=seed, field=field)
  dtype = dtype or cfg.param_dtype
  hf_export.export_hf(out_dir, cfg, params, tokenizer, dtype=dtype,
                      max_position_embeddings=max_position_embeddings,
                      extra_metadata={"source": model_cfg.checkpoint or f"random {model_cfg.size}"})
  back_cfg, back = hf_import.read_hf(out_dir, dtype=dtype)
  want = hf_export.params_to_hf(cfg, params, dtype)
  got = hf_export.params_to_hf(back_cfg, back)
  bad = [name for name in want if not np.array_equal(want[name], got[name])]
  if bad:  # would mean an exporter/importer bug: never hand out such a directory silently
    raise RuntimeError(f"Export round trip is not exact for {bad[:3]} ({len(bad)} tensors).")
  files = sorted(os.listdir(out_dir))
  return dict(source=model_cfg.checkpoint or f"random {model_cfg.size}", out_dir=out_dir,
              dtype=dtype, num_params=int(sum(x.size for x in jax.tree.leaves(params))),
              model=dataclasses.asdict(back_cfg),
              files=files, bytes=sum(os.path.getsize(os.path.join(out_dir, f)) for f in files),
              seconds=round(time.perf_counter() - t0, 2), round_trip_exact=True)


def run(config, workdir: str) -> dict:
  if config.export.dtype:
    presets.check_dtype(config.export.dtype, "export.dtype")
  checks.integer(config.export.max_position_embeddings, "export.max_position_embeddings", 1,
                 " (the context length written into config.json)")
  tokenizer = tokenizer_lib.get_tokenizer(config.tokenizer)
  summary = export_model(config.model, tokenizer, workdir, seed=config.seed,
                         dtype=config.export.dtype,
                         max_position_embeddings=config.export.max_position_embeddings)
  print(json.dumps(summary, indent=2))
  print(f"\nLoad it with transformers: AutoModelForCausalLM.from_pretrained({workdir!r}), "
        f"or in spec_jax: --config.model.checkpoint={workdir}")
  return summary
