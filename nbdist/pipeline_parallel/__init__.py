"""Pipeline parallelism: split a model into stages across ranks and run any schedule for real.

Notebook side: api.py (Pipeline), stepper.py (Stepper: a step tick by tick), stages.py (cutting the model),
inputs.py (a batch, inputs and model checked before a step), stepping.py (ticks and the timelines a stepped step is
read on), view.py (the live view), pipedream.py (PipeDream's semantics in one process, the reference). Plain data
read on both sides: spec.py (what each rank receives). What runs on the ranks is in ranks/ (pipeline.py,
executor.py, transport.py). Why a step idles, and its trace for Perfetto: Pipeline.bubbles(), Pipeline.export_trace()
(nbdist/debugging/).

Names are imported on first use: a rank that reads spec.py does not import the notebook side with it.
"""
from importlib import import_module

_EXPORTS = {"Pipeline": "api", "pipeline": "api", "Stepper": "stepper"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"nbdist.pipeline_parallel.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'nbdist.pipeline_parallel' has no attribute {name!r}")
