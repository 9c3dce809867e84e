"""Moved: device_description and time_call to spec_jax.evaluation.timing, write_results to
spec_jax.evaluation.report. Only experiments/distillspec/run.py still imports this name; delete
this file once it reads timing and report directly."""

from spec_jax.evaluation.report import write_results  # noqa: F401
from spec_jax.evaluation.timing import device_description, time_call  # noqa: F401
