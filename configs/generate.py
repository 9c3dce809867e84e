"""Generate text with SmolLM2-135M-Instruct (or any model) for a few prompts.

  python launch.py --config configs/generate.py --workdir runs/generate
  python launch.py --config configs/generate.py:temperature=0.7 --workdir runs/generate \
      --config.prompts_file=my_prompts.txt
  python launch.py --config configs/generate.py:smoke --workdir /tmp/gen   # tiny random model
  python launch.py --config configs/generate.py:method=sd,gamma=4 --workdir runs/generate_sd \
      --config.drafter.checkpoint=runs/quickstart/drafter   # speculative, prints τ per prompt
  python launch.py --config configs/generate.py:method=rsd_c@3,temperature=1 --workdir runs/gen_rsd
  python launch.py --config configs/generate.py:chat=False --workdir runs/gemma3 \
      --config.model.checkpoint=gemma3-270m --config.tokenizer=gemma3-270m   # Gemma 3 270M (base)

Time: ~30 s on 2 CPU cores (a few seconds loading the GGUF, ~1 s per prompt batch); Gemma 3 270M
~40 s. GPU not measured yet.
"""

from configs import common
from spec_jax.decoding import methods


def get_config(arg=None):
  args = common.parse_arg(arg, smoke=False, temperature=0.0, new_tokens=48, chat=True,
                         method="autoregressive", gamma=4, drafter="runs/quickstart/drafter")
  config = common.base("generate")
  config.mesh = common.mesh(data=1)  # one device; --config.mesh.* decodes each batch on several
  config.model = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.generation = common.generation(max_new_tokens=args.new_tokens, max_prompt_tokens=96,
                                        batch_size=4)
  config.generation.sampling.temperature = args.temperature
  config.chat = args.chat  # wrap prompts in the tokenizer's chat template
  # Speculative decoding: `method` NAME[:SHAPE][@L], a registered method
  # (spec_jax.decoding.methods: sd, the trees rsd_c / rsd_s / specinfer / spectr, lookup, ...)
  # drafted by `drafter` (a checkpoint; '' = a random drafter.size model), depth `gamma` unless
  # @L; each method's options sit under their group (config.lookup, config.bpd, ...).
  config.method = args.method
  config.gamma = args.gamma
  config.tree_width = 3
  config.update(methods.option_defaults())
  config.drafter = common.model(size="drafter-s", checkpoint=args.drafter)
  config.prompts = (
      "What is speculative decoding?",
      "Write a Python function that reverses a string.",
      "Give me three tips for learning to juggle.",
      "Who wrote Romeo and Juliet?",
  )
  config.prompts_file = ""
  config.prompts_mix = False  # True: prompts_file adds to prompts and the data prompts
  config.data = common.data()
  config.num_data_prompts = 0
  config.data_prompt_tokens = 64
  if args.smoke:
    config.tokenizer = "bytes"
    config.model = common.model(size="test-tiny")
    config.drafter = common.model(size="test-tiny")
    config.chat = False
    config.generation.max_new_tokens = 8
    config.generation.max_prompt_tokens = 64
  return config
