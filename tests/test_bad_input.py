"""Bad input across the programs: a value no run could use ends in one error naming its field,
before any model is initialised or any program compiled (a compile of a module that large is
the first sign of work; eager ops stay allowed)."""

import importlib

import jax
from jax._src import compiler
import pytest

from spec_jax import testing

# A module of this many characters is a model's init or a program, never one eager op (a jitted
# `jnp.zeros` is ~250 characters, the tiny model's init ~80,000).
WORK_CHARS = 20_000


class WorkStarted(AssertionError):
  pass


@pytest.fixture
def no_work(monkeypatch):
  """Fails the test at the first compile of a model's init or a program (`WORK_CHARS`)."""
  original = compiler.compile_or_get_cached

  def guarded(backend, computation, *args, **kwargs):
    if len(str(computation)) > WORK_CHARS:
      name = computation.operation.attributes["sym_name"]
      raise WorkStarted(f"{name} compiled before the bad input was refused")
    return original(backend, computation, *args, **kwargs)

  monkeypatch.setattr(compiler, "compile_or_get_cached", guarded)
  jax.clear_caches()  # a program compiled by an earlier test would run without compiling
  yield
  jax.clear_caches()


CASES = [
    ("train_lm", {"train.lr": float("nan")}, r"train.lr=nan must be a finite number >= 0"),
    ("train_lm", {"train.b2": 1.0}, r"train.b2=1.0 must be a finite number >= 0 and < 1"),
    ("train_lm", {"train.num_steps": -7}, r"train.num_steps=-7 must be an integer >= 1"),
    ("train_lm", {"train.keep_checkpoints": 0}, r"train.keep_checkpoints=0 must be an integer"),
    ("train_lm", {"model.dtype": "f8"}, r"model.dtype='f8' is not a dtype the models run in"),
    ("distill", {"train.warmup_steps": -1}, r"train.warmup_steps=-1 must be an integer >= 0"),
    ("distill", {"eval.temperatures": (0.0, -1.0)}, r"eval.temperatures=\(0.0, -1.0\): -1.0 is"),
    ("distill", {"eval.new_tokens": 0}, r"eval.new_tokens must be >= 1"),
    ("distill", {"eval.num_prompts": -1}, r"eval.num_prompts=-1 must be an integer >= 0"),
    ("distill", {"verifier.dtype": "f8"}, r"verifier.dtype='f8' is not a dtype"),
    ("train_bpd", {"train.grad_clip": float("nan")}, r"train.grad_clip=nan must be a finite"),
    ("train_steering", {"steering.lr_scale": float("nan")}, r"steering.lr_scale=nan must be > 0"),
    ("train_steering", {"steering.verifier_layers": ("a",)},
     r"steering.verifier_layers=\('a',\) must be verifier layer indices"),
    ("generate", {"num_data_prompts": -7}, r"num_data_prompts=-7 must be an integer >= 0"),
    ("generate", {"model.dtype": "f8"}, r"model.dtype='f8' is not a dtype"),
    ("generate", {"model.size": "llama-9t"}, r"Unknown model size 'llama-9t' \(model.size\)"),
    ("train_lm", {"tokenizer": "gpt5"}, r"tokenizer='gpt5' is no tokenizer here"),
    ("train_lm", {"data.name": "tiny_stories"}, r"data.name='tiny_stories': Unknown dataset"),
    ("quickstart", {"reduced.data.name": "sharegtp"},
     r"quickstart section 'reduced' .*data.name='sharegtp': Unknown dataset"),
    ("evaluate", {"eval.epsilons": ("x",)}, r"eval.epsilons has x: lenience"),
    ("evaluate", {"data_prompt_tokens": 0}, r"data_prompt_tokens=0 must be an integer >= 1"),
    ("evaluate", {"drafter.dtype": "f8"}, r"drafter.dtype='f8' is not a dtype"),
    ("benchmark", {"benchmark.batch_sizes": ()}, r"benchmark.batch_sizes=\(\) must hold integers >= 1 \(at least one\)"),
    ("benchmark", {"benchmark.prompt_tokens": -7}, r"benchmark.prompt_tokens=-7 must be an"),
    ("benchmark_sampling", {"benchmark.vocab_size": -7}, r"benchmark.vocab_size=-7 must be"),
    ("benchmark_sampling", {"benchmark.batch_sizes": (-7,)}, r"benchmark.batch_sizes=\(-7,\)"),
    ("benchmark_hf", {"benchmark.torch_threads": -7}, r"benchmark.torch_threads=-7 must be an"),
    ("benchmark_hf", {"benchmark.torch_dtype": "f8"}, r"benchmark.torch_dtype='f8': transformers"),
    ("export_hf", {"export.dtype": "f8"}, r"export.dtype='f8' is not a dtype"),
    ("export_hf", {"export.max_position_embeddings": -7},
     r"export.max_position_embeddings=-7 must be an integer >= 1"),
    ("pod_plan", {"plan.prompt_tokens": -7}, r"plan.prompt_tokens=-7 must be an integer >= 1"),
    ("pod_plan", {"plan.plans": ()}, r"plan.plans is empty"),
    ("quickstart", {"drafter.train.lr": -1.0},
     r"quickstart section 'drafter' \(--config.drafter.<field>\): train.lr=-1.0 must be"),
    ("quickstart", {"evaluate.eval.methods": ("bogus",)},
     r"quickstart section 'evaluate' .*eval.methods has 'bogus', which is not a method"),
    ("experiments.rsd.config", {"eval.batch_sizes": ()}, r"eval.batch_sizes is empty"),
    ("experiments.rsd.config", {"fixed_depths": (2, -7)}, r"fixed_depths=\(2, -7\) must hold integers >= 1\."),
    ("experiments.drafters.config", {"scratch_steps": -7}, r"scratch_steps=-7 must be an integer"),
    ("experiments.rsd.config", {"budget_methods.K3_B4": ("rsd_c",)},
     r"config.budget_methods\['K3_B4'\] has 'rsd_c': each entry is 'NAME\[:WIDTH\]@L'"),
    ("quickstart", {"stages": ("drafter", "typo")}, r"stages=\('drafter', 'typo'\): 'typo' is no"),
    ("quickstart", {"drafter.model.size": "drafter-xxl"},
     r"quickstart section 'drafter' .*Unknown model size 'drafter-xxl' \(model.size\)"),
    ("quickstart", {"evaluate.tokenizer": "gpt5"},
     r"quickstart section 'evaluate' .*tokenizer='gpt5' is no tokenizer here"),
    ("quickstart", {"generate.generation.batch_size": 0},
     r"quickstart section 'generate' .*generation.batch_size=0 must be >= 1"),
    ("experiments.bpd.config", {"ngram_beams": (0,)}, r"ngram_beams=\(0,\) must hold integers >= 1"),
]


@pytest.mark.parametrize("program, overrides, message", CASES,
                         ids=[f"{p}:{','.join(o)}" for p, o, _ in CASES])
def test_refused_naming_the_field_before_any_work(tmp_path, no_work, program, overrides, message):
  module = program if "." in program else f"configs.{program}"  # an experiment's config module
  config = importlib.import_module(module).get_config("smoke")
  config = testing.with_overrides(config, overrides)
  with pytest.raises(ValueError, match=message):
    testing.dispatch(config, str(tmp_path))


@pytest.mark.parametrize("experiment", ["specbench", "stop", "dyn"])
def test_a_missing_bpd_checkpoint_is_named_by_the_experiments_field(tmp_path, no_work, experiment):
  config = importlib.import_module(f"experiments.{experiment}.config").get_config("smoke")
  config.bpd_checkpoint = str(tmp_path / "no_heads")
  with pytest.raises(FileNotFoundError, match=rf"^bpd_checkpoint='{tmp_path}/no_heads' \(the BPD "
                                              r"heads' evaluate runs.*No checkpoint at"):
    testing.dispatch(config, str(tmp_path / "run"))


def test_the_guard_sees_work(tmp_path, no_work):
  """A good config reaches its first program: the guard above is what stops it."""
  from configs import generate  # noqa: PLC0415
  with pytest.raises(WorkStarted, match="compiled before"):
    testing.dispatch(generate.get_config("smoke"), str(tmp_path))
