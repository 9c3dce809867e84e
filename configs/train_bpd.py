"""Train blockwise-parallel-decoding heads on a frozen verifier (program: train_bpd).

  python launch.py --config configs/train_bpd.py --workdir runs/bpd_h3_1000      # SmolLM2, h = 3
  python launch.py --config configs/train_bpd.py:heads=5,loss=ce,steps=2000 --workdir runs/bpd_h5
  python launch.py --config configs/train_bpd.py:smoke --workdir /tmp/bpd       # tiny, seconds
Then decode with the heads as a drafter (BPD, no drafter model):
  python launch.py --config configs/evaluate.py:gammas=3 --workdir runs/eval_bpd \
      --config.drafter.checkpoint=runs/bpd_h3_1000

Arguments (`:key=value,...`): heads (h), hidden (each head's width; 0 = the verifier's), loss
(fkl: distil the verifier's own next-token laws, Medusa-2 style; ce: corpus tokens), steps,
batch, seq_len, lr, data (a TFDS name, or sharegpt), source and temp (sharegpt only), vocab
(bpd.train_vocab: 0 = the loss over the whole vocabulary; N = over the train split's N most
frequent tokens, which cuts the heads' projections N / V), smoke. Head k predicts the token
k + 1 positions after the verifier's position (the verifier's own head is position 1) and weighs
decay^(k-1) in the loss.
Re-running the same command resumes from the newest checkpoint in the workdir.

ShareGPT (`data=sharegpt`: data.name=spec_jax_sharegpt, spec_jax/training/chat_data.py): rows of
a chat prompt of <= 128 tokens (longer ones skipped and counted in the log) and the first 128
tokens of its response, the loss on the response tokens only; the response is the corpus's
(source=fixed) or the verifier's own, sampled at temp (source=verifier, generated once and
cached in data.cache_dir, as distill does):
  python launch.py --config configs/train_bpd.py:data=sharegpt,vocab=8192 --workdir runs/bpd_chat
  python launch.py --config configs/train_bpd.py:data=sharegpt,source=verifier,temp=0,vocab=8192 \
      --workdir runs/bpd_chat_verifier_t0
Held-out metrics: validation rows with the corpus's responses. A step costs about what a corpus
step of seq_len = 255 does (rows of 128 + 128 tokens).

Time on 2 idle CPU cores (SmolLM2-135M verifier, batch 8 × 128 tokens): the verifier's forward
and the heads' 49,152-way projections dominate: ~3.7 s per step for h = 3, ~5.4 s for h = 5
(the loss projects one head at a time), ~2.0 s for h = 5 with vocab=8192 (98.6% of the
Python-code split's tokens are among those 8192). Thousands of steps, as Medusa trains, need a
GPU. Measured runs: experiments/bpd/notes.md.
Smoke: the test-tiny verifier, byte tokenizer, 20 steps.
"""

from configs import common
from configs import distill as distill_config


def get_config(arg=None):
  args = common.parse_arg(arg, heads=3, hidden=0, loss="fkl", steps=1000, batch=8, seq_len=128,
                          lr=1e-3, data="spec_jax_shakespeare", source="fixed", temp=1.0,
                          vocab=0, smoke=False)
  chat = args.data in ("sharegpt", distill_config.SHAREGPT)
  if args.source != "fixed" and not chat:
    raise ValueError(f"source={args.source!r} needs data=sharegpt (corpus windows train on "
                     "their own text).")
  config = common.base("train_bpd")
  config.verifier = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.data = common.data(name=distill_config.SHAREGPT if chat else args.data,
                            seq_len=args.seq_len)
  if chat:  # a row is prompt_tokens + response_tokens (distill's data fields)
    del config.data["seq_len"]
    config.data.update(source=args.source, prompt_tokens=128, response_tokens=128,
                       temperature=args.temp, stop_at_eos=True, verifier_batches=0,
                       generate_batch=64, cache_dir="")
  config.bpd = dict(num_heads=args.heads, hidden=args.hidden, own_projection=False,
                    loss=args.loss, decay=0.8, top_k=5,
                    train_vocab=args.vocab)
  config.train = common.train(num_steps=args.steps, batch_size=args.batch)
  config.train.update(lr=args.lr, warmup_steps=min(50, max(args.steps // 10, 1)))
  if args.smoke:
    config.tokenizer = "bytes"
    config.verifier = common.model(size="test-tiny", checkpoint="")
    if chat:
      config.data.update(prompt_tokens=320, response_tokens=40, generate_batch=0)
    else:
      config.data.seq_len = 32
    config.train.update(num_steps=20, batch_size=8, warmup_steps=5, log_every=5, eval_every=10,
                        eval_batches=2, checkpoint_every=10)
  return config
