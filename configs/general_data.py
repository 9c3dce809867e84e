"""General-domain distillation data: the verifier answers self-written instructions about 69 seed
topics and requests to continue Shakespeare and Python prefixes (program: general_data).

  python launch.py --config configs/general_data.py --workdir runs/general_data
  python launch.py --config configs/general_data.py:smoke --workdir /tmp/general   # tiny

Writes the local TFDS dataset `spec_jax_general/<name>` into the data dir (the name is printed
and saved in WORKDIR/general_data.json, e.g. spec_jax_general/smollm2_s0_t69_c64_r96_T1p0_c2416b),
deterministic given `seed`; a dataset already prepared is reused. Train on it with
  python launch.py --config configs/distill.py --workdir runs/distill_general \
      --config.data.name=spec_jax_general/smollm2_s0_t69_c64_r96_T1p0_c2416b
Time on 2 CPU cores: ~6.5 min for the default (333 documents). Smoke: tiny random model, bytes.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, seed=0, topics=69, corpus_prompts=64,
                          response_tokens=96)
  config = common.base("general_data")
  del config["mesh"]
  config.seed = args.seed
  config.verifier = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.data_dir = ""  # '' = $SPEC_JAX_DATA_DIR or ~/.cache/spec_jax/tensorflow_datasets
  # spec_jax.training.general_data.Spec: topics (the first N seed topics, 3 requests each),
  # corpus_prompts (prefixes of prefix_tokens tokens per corpus of `corpora`: leave out
  # spec_jax_pystdlib to keep code out of domain), the tokens each sampled instruction /
  # response may take, the sampling temperature and the generation batch.
  config.general = dict(topics=args.topics, corpus_prompts=args.corpus_prompts,
                        corpora=("spec_jax_shakespeare", "spec_jax_pystdlib"),
                        prefix_tokens=48, instruction_tokens=40,
                        response_tokens=args.response_tokens, temperature=1.0, batch_size=16)
  config.preview = 12  # examples written to WORKDIR/preview.jsonl
  if args.smoke:
    config.tokenizer = "bytes"
    config.verifier = common.model(size="test-tiny")
    config.general.update(topics=3, corpus_prompts=2, prefix_tokens=16, instruction_tokens=24,
                          response_tokens=16, batch_size=4)
  return config
