"""Export a spec_jax model (a trained drafter, SmolLM2 from its GGUF, ...) as an HF checkpoint.

  python launch.py --config configs/export_hf.py --workdir runs/hf/drafter  # the scratch drafter
  python launch.py --config configs/export_hf.py:source=smollm2 --workdir runs/hf/smollm2
  python launch.py --config configs/export_hf.py:source=gemma3-270m --workdir runs/hf/gemma3
  python launch.py --config configs/export_hf.py:source=PATH --workdir DIR  # any train_lm workdir
  python launch.py --config configs/export_hf.py:smoke --workdir /tmp/hf_tiny   # random tiny model

The workdir becomes an HF directory (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json with the ChatML template) that
`transformers.AutoModelForCausalLM.from_pretrained(workdir)` loads with the same logits, and
that spec_jax reads back as `--config.model.checkpoint=<workdir>` (bit for bit, checked before
the program returns). --config.export.dtype=bfloat16 halves the file.
The default source is the scratch quickstart drafter (common.SCRATCH_DRAFTER, made by
`configs/quickstart.py:recipe=scratch,vocab=0`): the main quickstart's drafter reads the verifier's
features and drafts from a reduced vocabulary, which an HF causal LM cannot hold (refused).
Time on 2 CPU cores (measured while other jobs shared them, so an upper bound): the scratch
drafter (15.7M params, 66 MB) 9 s in all, SmolLM2-135M from the GGUF (float32, 542 MB) 24 s, each
including the bit-for-bit re-read. GPU: not needed (numpy only).
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, source=common.SCRATCH_DRAFTER)
  config = common.base("export_hf")
  size = "smollm2-135m" if args.source == "smollm2" else "drafter-s"
  config.model = common.model(size=size, checkpoint=args.source)
  if args.source == "gemma3-270m":  # the packaged Gemma 3 with its own tokenizer
    config.tokenizer = "gemma3-270m"
  # dtype: tensor dtype in model.safetensors ('' = the model's own, float32 for every source here).
  # max_position_embeddings: the context length written to config.json (SmolLM2's is 8192).
  config.export = dict(dtype="", max_position_embeddings=8192)
  if args.smoke:
    config.tokenizer = "bytes"
    config.model = common.model(size="test-tiny", checkpoint="")
  return config
