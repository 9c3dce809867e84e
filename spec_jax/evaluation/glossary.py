"""The metrics glossary (docs/design.md §3): one definition per results.json key, printed with reports.

Every report prints the glossary entries of the columns it shows, because a bare "acceptance
length" is ambiguous (vLLM#13990, EAGLE#153). Table headers carry the paper symbol beside the
glossary name (`column_label`).
"""

from __future__ import annotations

from typing import Iterable

# One-line definitions, docs/design.md §3 wording. The order is the order the glossary is printed in.
GLOSSARY: dict[str, str] = {
    "method": "decoding method: autoregressive (one verifier call per token), sd (chain "
              "speculative decoding with a draft model), rsd_c, specinfer, ...",
    "gamma": "γ, draft length: draft tokens proposed per verifier call (tree depth for tree "
             "methods); none for autoregressive",
    "temperature": "sampling temperature applied to both drafter and verifier; 0 is greedy",
    "top_k": "top-k truncation of the sampling distribution (0 = off)",
    "top_p": "nucleus (top-p) truncation of the sampling distribution (1 = off)",
    "batch_size": "prompts decoded together; rows keep their own lengths (ragged acceptance)",
    "num_prompts": "prompts in the evaluation set",
    "new_tokens": "total tokens emitted over all prompts",
    "block_efficiency": "τ, block efficiency: tokens emitted per verifier call, bonus/correction "
                        "token included (chain SD with i.i.d. acceptance: "
                        "τ = (1-α^{γ+1})/(1-α))",
    "tau_se": "standard error of τ over prompts, as τ is computed (a ratio of sums: the "
              "delta method, each prompt weighing by its verifier calls; rows written before "
              "2026-11-29 hold the standard error of the per-prompt τ mean instead, which "
              "overstates it where prompts stop early)",
    "prompt_new_tokens": "tokens emitted for each prompt, in the prompt set's order",
    "prompt_verifier_calls": "verifier calls for each prompt, in the same order: two rows of "
                             "one prompt set compare paired over prompts (a difference of τ's "
                             "standard error from the per-prompt differences)",
    "mean_accepted_tokens": "τ - 1: accepted draft tokens per verifier call, except that a "
                            "last round cut at the token budget or by a stop token inside its "
                            "accepted drafts outputs no bonus token (up to 1/calls lower per "
                            "prompt)",
    "acceptance_rate": "α, acceptance rate: mean over draft positions of Σ_x min(p(x), q(x)), "
                       "p the verifier's and q the drafter's distribution",
    "empirical_acceptance": "empirical accept fraction: accepted draft tokens / draft tokens "
                            "the acceptance rule examined (a chain examines up to its first "
                            "rejection; not / proposed drafts: see drafts_per_call)",
    "per_position_acceptance": "per-position (conditional) acceptance: P(draft i accepted | "
                               "drafts 1..i-1 accepted), i = 1..γ",
    "candidates_per_call": "draft candidates at the depths the acceptance walk reached, per "
                           "verifier call (a chain: one a depth, up to its first rejection; a "
                           "tree: every sibling at a reached depth, those after the accepted "
                           "one included)",
    "drafts_per_call": "draft tokens proposed per verifier call (γ for a chain; fewer when rows "
                       "stop drafting early, sd_stop; a tree's drafted nodes)",
    "verifier_calls": "verifier forward calls summed over prompts, prefill excluded (a prompt "
                      "that finished takes none); autoregressive rows: one per emitted token, "
                      "the first the prefill's",
    "drafter_calls": "drafter forward calls (one per draft step), prefill excluded",
    "tokens_per_s": "wall-clock tokens emitted per second, whole batch, compilation excluded",
    "cpu_per_wall": "the process's CPU seconds (all threads) per wall second of the timed pass: "
                    "about the cores it kept busy; far below an idle run's value means the pass "
                    "was paused or starved and its tokens_per_s and speedup are suspect",
    "speedup": "speedup: wall-clock tokens/s of the method over autoregressive decoding of the "
               "same verifier, measured in the same process",
    "paired_speedup": "the median of paired_speedups",
    "paired_speedups": "speedups from eval.timing_pairs further passes, in each of which the "
                       "method and autoregressive decoding took turns prompt batch by batch "
                       "(the one running first alternating): both see the same minute of the "
                       "machine, where speedup divides by a pass timed minutes before",
    "baseline_tokens_per_s": "the tokens/s of the autoregressive pass this row's speedup "
                             "divides by (the same process's, on the same prompts)",
    "baseline": "earlier: the row was read back from an earlier process's rows.jsonl while its "
                "(T, B) baseline was measured again, so its speedup divides by that earlier "
                "process's autoregressive pass (baseline_tokens_per_s), not by this table's; "
                "rerun in a fresh workdir for ratios from one process",
    "cost_ratio_c": "c: drafter step time / verifier one-token step time (autoregressive "
                    "decoding at the same batch size), measured",
    "verifier_cost_ratio_r": "r(M): time of one verifier forward over the M tokens of a call "
                             "(verifier_tokens_per_call) / its time over 1 token, same batch and "
                             "cache size, measured (near 1 on a GPU for small M, above it on a "
                             "CPU)",
    "theoretical_speedup": "theoretical speedup τ/(r(M) + d·c), with τ, r(M) "
                           "(verifier_cost_ratio_r) and c (cost_ratio_c) measured and d = "
                           "drafter_calls_per_round; a tree's calls feed several tokens each, "
                           "so its round drafts for drafter_c = Σ_w c(w) instead of d·c",
    "drafter_c": "a round's drafting in one-token verifier calls: d·c for a chain, Σ_w c(w) "
                 "over a tree's calls (call_costs)",
    "call_widths": "a tree's drafter calls in one round: the tokens each feeds (the root's 1, "
                   "then each drafted level but the deepest)",
    "call_costs": "c(w) of each of a tree's calls: c times the drafter's forward on w tokens "
                  "over its forward on 1 (measured in the same run)",
    "reference_vs_step": "the verifier's one-token forward, timed beside r(M), c and s(w), over "
                         "the autoregressive pass's step (the largest over those timings); a "
                         "timing is repeated after a pause while this is over 1.5, so a value "
                         "above 1.5 says the cost ratios ran in a slow spell of the machine and "
                         "the theory is suspect",
    "speedup_vs_theory": "measured speedup / theoretical speedup",
    "verifier_tokens_per_call": "cost at fixed budget: tokens fed to the verifier per call "
                                "(chain γ+1, tree node count)",
    "drafter_calls_per_round": "d: drafter forward calls per verification round (chain γ, tree "
                               "depth L: one call per level)",
    "tree": "draft tree shape: rsd_c b=branching per depth, rsd_s W=beam width, specinfer/spectr "
            "K=i.i.d. chains; L = depth",
    "identical_to_greedy": "exactness check: greedy speculative output equals the verifier's "
                           "greedy output token for token (none when sampling)",
    "prompt_widths": "padded prompt widths P the run's batches took (each batch: the smallest "
                     "eval.prompt_buckets width holding its longest prompt); prefill processes "
                     "P tokens per row",
    "lenience": "lossy lenience function (f_lin = p/ε, f_sq = p/ε², f_exp = p^ε); none is "
                "lossless",
    "epsilon": "ε, the lenience parameter",
    "verifier_loglik": "quality: mean log-likelihood per generated token under the raw verifier "
                       "(temperature 1, no truncation), teacher-forced on the generated text",
    "token_tv": "quality cost of lossy decoding: mean over generated positions of ½‖π - p‖₁, "
                "π the one-step law of the lenient rule, p the verifier's (0 when lossless)",
    "dataset": "prompt set",
    "drafter": "draft model",
    "seed": "random seed of the sampling rng",
    "device": "accelerator the timings were taken on",
}

# The symbols the papers use, shown beside the glossary name in table headers.
SYMBOLS: dict[str, str] = {
    "gamma": "γ", "temperature": "T", "block_efficiency": "τ", "mean_accepted_tokens": "τ-1",
    "acceptance_rate": "α", "cost_ratio_c": "c", "verifier_cost_ratio_r": "r(M)",
    "drafter_calls_per_round": "d", "epsilon": "ε"}


def column_label(key: str) -> str:
  """Header text: the glossary name, with its symbol where the papers use one."""
  return f"{key} ({SYMBOLS[key]})" if key in SYMBOLS else key


def markdown_lines(keys: Iterable[str]) -> list[str]:
  """'- **key**: definition' for each glossary key in `keys`, in glossary order (unknown keys,
  e.g. a program's own diagnostics, are skipped)."""
  wanted = set(keys)
  return [f"- **{key}**: {text}" for key, text in GLOSSARY.items() if key in wanted]
