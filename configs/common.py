"""Config pieces shared by every experiment. Each `configs/X.py` builds on these.

Field meanings are documented once, here. Programs read only the sections they need.
"""

from __future__ import annotations

import ml_collections


# The drafter the RSD, DistillSpec, steering, BPD-rescorer and cost-model experiments' committed
# results were measured with: drafter-s, 300 steps of train_lm on Shakespeare (the quickstart's
# `recipe=scratch`). Rebuild it with
#   python launch.py --config configs/quickstart.py:recipe=scratch,vocab=0 \
#       --workdir runs/quickstart_scratch
SCRATCH_DRAFTER = "runs/quickstart_scratch/drafter"


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """big_vision-style `--config configs/x.py:key=value,flag` → typed ConfigDict over `defaults`.

  A bare key means True. Values are converted to the type of the default; unknown keys are an error.
  """
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    return out
  for item in arg.split(","):
    key, _, value = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"Unknown config argument {key!r}; known: "
                       f"{', '.join(sorted(defaults)) or 'none (this config takes no :args)'}.")
    default = defaults[key]
    if not _:
      value = "True"
    if isinstance(default, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"Config argument {key!r} must be true/false, got {value!r}.")
      out[key] = value.lower() in ("true", "1")
    else:
      try:
        out[key] = type(default)(value)
      except ValueError:
        raise ValueError(f"Config argument {key!r} must be {type(default).__name__}, "
                         f"got {value!r}.") from None
  return out


def plus_list(args: ml_collections.ConfigDict, key: str, kind: type = int) -> tuple:
  """The `:arg` `key` written as numbers joined by '+' (`gammas=2+4+6`), as a tuple of `kind`."""
  try:
    return tuple(kind(x) for x in args[key].split("+") if x)
  except ValueError:
    raise ValueError(f"Config argument {key!r} must be {kind.__name__}s joined by '+' (e.g. "
                     f"{key}=1+2), got {args[key]!r}.") from None


def given(arg: str | None) -> set[str]:
  """The keys an `:arg` string sets explicitly: a smoke variant keeps them instead of its own
  defaults (`configs/distill.py:smoke,divergence=rkl` trains RKL)."""
  return {item.partition("=")[0].strip() for item in (arg or "").split(",") if item.strip()}


def model(size: str = "drafter-s", checkpoint: str = "", dtype: str = "float32"):
  """A model: a size variant trained from scratch, or loaded.

  size: variant name from `spec_jax.models.families` ('smollm2-135m', 'drafter-s',
    'gemma3-270m', ...) or an architecture preset at a published shape with random weights
    (`spec_jax.models.presets`: 'llama3.2-1b', 'llama3.1-8b', 'llama3.1-70b', 'qwen3-8b',
    'gemma3-27b', ...; for speed and memory work), optionally with what to keep of the loaded model after colons
    (`spec_jax.models.draft_init`): 'smollm2-135m:layers=0,14,29' (or first=K, every=M) keeps
    those blocks of `checkpoint` (a verifier-initialised drafter: with checkpoint='smollm2');
    ':vocab=N' keeps an output layer over the N most frequent tokens of the training data
    (train_lm and distill build it; the trained checkpoint then carries it); ':fused=1' (q/k/v
    and gate/up as one weight product each) and ':unrolled=1' (layers written out with
    per-layer weights) are layouts of the same model, for speed work; ':decode_unrolled=1'
    writes out the layer scan of the calls with a cache over the same stacked weights;
    ':out_major=1' stores the o and down weights output axis first; ':fused=1:pallas=1' runs
    the decoding calls' layers as hand-written GPU kernels (spec_jax/models/pallas_layers.py),
    ':attn_kernel=1' only their attention, in XLA's layers.
  checkpoint: '' (random init), 'smollm2' or 'gemma3-270m' (the packaged GGUFs), a .gguf path, an
    HF checkpoint directory (config.json + safetensors; 'hf:' prefix optional), or a train_lm
    workdir / checkpoint directory (its saved model config wins over `size`).
  dtype: compute dtype ("float32" or "bfloat16"); inference params are cast to it, training
    keeps float32 params (AdamW updates of bfloat16 weights lose their low bits).
  """
  return ml_collections.ConfigDict(dict(size=size, checkpoint=checkpoint, dtype=dtype))


def data(name: str = "spec_jax_shakespeare", seq_len: int = 256):
  """A text corpus read with tfds.data_source.

  name: 'spec_jax_shakespeare', 'spec_jax_pystdlib', or any TFDS dataset prepared locally in
    array_record format. data_dir: '' means $SPEC_JAX_DATA_DIR or ~/.cache/spec_jax/tensorflow_datasets.
  """
  return ml_collections.ConfigDict(dict(
      name=name, text_key="text", data_dir="", seq_len=seq_len,
      train_split="train", eval_split="validation", prompt_split="test"))


def train(num_steps: int = 1000, batch_size: int = 16):
  """AdamW with linear warmup then cosine decay to `end_lr_frac * lr`."""
  return ml_collections.ConfigDict(dict(
      num_steps=num_steps, batch_size=batch_size, lr=3e-3, end_lr_frac=0.1, warmup_steps=50,
      weight_decay=0.1, b1=0.9, b2=0.95, grad_clip=1.0,
      log_every=10, eval_every=200, eval_batches=8, checkpoint_every=200, keep_checkpoints=2))


def mesh(data: int = -1, fsdp: int = 1, tensor: int = 1):
  """Device mesh axes. -1 takes all remaining devices. Batches shard over (data, fsdp); params
  shard over fsdp (largest divisible dim) and tensor; decoding's KV caches shard their rows over
  (data, fsdp) and their key/value heads over tensor. Decoding programs default to one device
  (data=1): every batch size must divide over data*fsdp and both models' KV heads over tensor."""
  return ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, tensor=tensor))


def sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
  """temperature 0 means greedy; top_k 0 means off; top_p 1.0 means off."""
  return ml_collections.ConfigDict(dict(temperature=temperature, top_k=top_k, top_p=top_p))


def generation(max_new_tokens: int = 64, max_prompt_tokens: int = 128, batch_size: int = 8):
  return ml_collections.ConfigDict(dict(
      max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
      sampling=sampling(), stop_at_eos=True))


def base(program: str) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.program = program
  config.seed = 0
  # 'smollm2', 'gemma3-270m', 'bytes', an HF model dir, a tokenizer.json/.gguf path
  config.tokenizer = "smollm2"
  config.mesh = mesh()
  return config
