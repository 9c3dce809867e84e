"""DistillSpec: distill the SmolLM2 verifier into a drafter (program: distill).

  python launch.py --config configs/distill.py --workdir runs/distill_jsd_fixed
  python launch.py --config configs/distill.py:divergence=tvd,source=onpolicy \
      --workdir runs/distill_tvd_onpolicy --config.drafter.checkpoint=runs/quickstart/drafter
  python launch.py --config configs/distill.py:smoke --workdir /tmp/distill   # tiny, for tests
Arguments (`:key=value,...`): divergence (fkl, rkl, jsd, tvd, or xent = no teacher), beta
(JSD[β], β weights the verifier), source (fixed, verifier, onpolicy, mix), lam (on-policy
fraction of a mix), steps, batch, drafter (a train_lm/distill workdir, '' = from scratch), size,
data (TFDS name), smoke. Any field can also be overridden: --config.distill.temperature=0.7.
Re-running the same command resumes from the newest checkpoint in the workdir.
Evaluate the result with
  python launch.py --config configs/evaluate.py --workdir runs/eval_distilled \
      --config.drafter.checkpoint=runs/distill_jsd_fixed

Expected time on 2 idle CPU cores: one step of drafter-s with the SmolLM2 verifier at batch 8 ×
(32 prompt + 48 response) tokens ~2.4 s on fixed data and ~2.8 s with on-policy generation
(40 steps: ~2 min, plus ~1 min of loading and compiling). Verifier-generated data costs one
verifier generation per batch, once (cached in data.cache_dir; ~15 min for 40 batches of 8 × 48
tokens). A pool sampled in larger calls is ~2× faster per token:
`--config.data.verifier_batches=64 --config.data.generate_batch=32` (64 batches, cycled; 32 rows
per call; ~10 s for 64 batches of 8 × 112 tokens on one H100).
One H100: 2000 steps of a 4-block verifier-initialised drafter (8k vocabulary) at batch 8 ×
(32 + 48) tokens in ~1 min with compilation; the quickstart's feature drafter at ~20 steps/s.
Measured runs: experiments/distillspec/notes.md, experiments/gpu/results.md.
Reference (drafter-s from the quickstart drafter, 40 steps, lr 1e-3, 16 held-out prompts, γ = 4,
T = 1): JSD[0.5] on fixed data moves SD's α from 0.28 (40 steps of cross-entropy instead) to
0.37 and τ from 1.39 to 1.55 (+11.5%); experiments/distillspec/results.md has the full
{FKL, RKL, JSD, TVD} × {fixed, verifier, on-policy, mix} grid.

Smoke (CPU tests, seconds): test-tiny verifier and drafter, byte tokenizer, 6 steps of FKL on
8 × (8 + 8) tokens of on-policy data refreshed every 2 steps.
"""

from configs import common


def get_config(arg: str | None = None):
  arg_string = arg
  # Defaults: the best cheap setting of experiments/distillspec (JSD[0.5] on the dataset's own
  # continuations: no generation cost, and the highest τ at T = 1 there).
  arg = common.parse_arg(arg, divergence="jsd", beta=0.5, source="fixed", lam=0.5, steps=40,
                         batch=8, drafter="runs/quickstart/drafter", size="drafter-s",
                         data="spec_jax_shakespeare", lr=1e-3, smoke=False)
  config = common.base("distill")
  config.verifier = common.model(size="smollm2-135m", checkpoint="smollm2")
  config.drafter = common.model(size=arg.size, checkpoint=arg.drafter)
  config.data = common.data(name=arg.data)
  del config.data["seq_len"]  # a distillation row is prompt_tokens + response_tokens
  config.data.update(
      source=arg.source,        # fixed | verifier | onpolicy | mix (spec_jax.training.distill_data)
      prompt_tokens=32, response_tokens=48,
      temperature=1.0,          # sampling temperature of generated responses (0 = greedy)
      refresh_every=1,          # on-policy responses regenerated every N steps
      mix_with="verifier",      # a mix's non-on-policy rows: fixed | verifier
      mix_lambda=arg.lam,       # on-policy fraction of every batch in a mix (GKD's λ)
      # source = verifier: a pool of this many generated batches, cycled (0 = one per step);
      # the share of each batch's rows taken from it (the rest: the corpus's text); rows per
      # generation call (0 = one batch's; 64 samples ~2x faster than 8 on 2 CPU cores).
      verifier_batches=0, verifier_share=1.0, generate_batch=0,
      stop_at_eos=False,        # False: responses always have response_tokens tokens
      cache_dir="",             # verifier responses; '' = <workdir>/data_cache
      # (name, fraction) pairs: round(fraction·B) rows of every training batch come from each
      # of these datasets' train_split, the rest from `name` (which alone serves the held-out
      # eval); a reduced vocabulary is counted on the blend. E.g. (("spec_jax_general/...",
      # 0.5),) for general-domain data beside the corpus.
      blend=())
  config.distill = dict(
      divergence=arg.divergence, beta=arg.beta,
      # Both laws get this transform (as at decoding time); temperature must be > 0.
      temperature=1.0, top_k=0, top_p=1.0,
      # A feature drafter (size '...:features=1') also regresses its final residual onto the
      # verifier's with this weight (EAGLE's feature loss; training/features.py).
      feature_weight=1.0,
      # ... and trains on its own predicted features: pass k + 1 reads what pass k predicted.
      feature_passes=1)
  config.train = common.train(num_steps=arg.steps, batch_size=arg.batch)
  config.train.update(lr=arg.lr, warmup_steps=max(min(10, arg.steps // 10), 1), log_every=5,
                      eval_every=arg.steps, checkpoint_every=20, keep_checkpoints=1)
  del config.train["eval_batches"]  # held-out batches are eval.batches here
  config.eval = dict(
      batches=4,                # held-out windows for eval/{fkl,...,alpha}
      at_start=True,            # also evaluate the initial drafter (logged at step 0)
      gamma=4, temperatures=(0.0, 1.0), num_prompts=8, new_tokens=48)
  if arg.smoke:
    config.tokenizer = "bytes"
    config.verifier = common.model(size="test-tiny")
    config.drafter = common.model(size="test-tiny")
    config.drafter.checkpoint = ""
    # FKL on on-policy data: the smoke exercises generation, refresh and resume (other
    # settings: --config.data.source=..., --config.distill.divergence=...).
    explicit = common.given(arg_string)
    config.data.update(prompt_tokens=8, response_tokens=8, refresh_every=2)
    if "source" not in explicit:
      config.data.source = "onpolicy"
    if "divergence" not in explicit:
      config.distill.divergence = "fkl"
    config.train.update(num_steps=6, batch_size=8, warmup_steps=1, log_every=1, eval_every=3,
                        checkpoint_every=2, lr=3e-3)
    config.eval.update(batches=2, num_prompts=2, new_tokens=8)
  return config
