"""Train a drafter LM from scratch with next-token cross-entropy (program: train_lm).

Command (drafter-s on Shakespeare with the SmolLM2 tokenizer, 49k vocabulary):
  python launch.py --config configs/train_lm.py:size=drafter-s,steps=1000 --workdir runs/drafter_s
Arguments (`:key=value,...`): size (model variant), steps, data (TFDS name), batch, seq_len,
lr, smoke. Any field can also be overridden: --config.train.lr=1e-3. Re-running the same command
resumes from the newest checkpoint in the workdir; a finished run returns at once.

Expected time, 2 CPU cores (measured): drafter-s (15.7M params), batch 16 x 128 tokens: ~2.3 s
per step on idle cores (~0.43 steps/s, ~900 tokens/s; the 49k-way output layer and its gradient
are most of it), plus ~10 s of compilation → 1000 steps ≈ 40 min. One GPU: not measured yet.
Reference (100 steps, lr 3e-3, warmup 10): train loss 10.8 at step 1, 9.24 (mean of steps 1-10),
6.82 @20, 6.51 @40, 6.22 @60, 6.17 @80, 6.05 @100; eval loss 5.96, eval accuracy 0.156 @100.

Smoke (CPU tests, seconds): test-tiny model, byte tokenizer, 20 steps of 8 x 32 tokens; it
overrides size/steps/batch/seq_len:
  python launch.py --config configs/train_lm.py:smoke --workdir /tmp/train_lm_smoke
"""

from configs import common


def get_config(arg: str | None = None):
  arg = common.parse_arg(arg, size="drafter-s", steps=1000, data="spec_jax_shakespeare",
                         batch=16, seq_len=128, lr=3e-3, smoke=False)
  config = common.base("train_lm")
  config.model = common.model(size=arg.size)
  config.data = common.data(name=arg.data, seq_len=arg.seq_len)
  config.train = common.train(num_steps=arg.steps, batch_size=arg.batch)
  config.train.lr = arg.lr
  config.train.warmup_steps = min(config.train.warmup_steps, max(arg.steps // 10, 1))
  if arg.smoke:
    config.tokenizer = "bytes"
    config.model.size = "test-tiny"
    config.data.seq_len = 32
    config.train.update(num_steps=20, batch_size=8, warmup_steps=5, log_every=5, eval_every=10,
                        eval_batches=2, checkpoint_every=10)
  return config
