"""Pipeline parallelism: split a model into stages across ranks and run any schedule for real.

Notebook side: api.py (Pipeline), stepper.py (Stepper: a step tick by tick), spec.py (what each rank receives, plain
data), stages.py (cutting the model), stepping.py (ticks and the timelines a stepped step is read on), pipedream.py
(PipeDream's semantics in one process, the reference). What runs on the ranks is in nbdist/engine/ (pipeline.py,
executor.py, transport.py).
"""
from nbdist.pipeline_parallel.api import Pipeline, pipeline
from nbdist.pipeline_parallel.stepper import Stepper

__all__ = ["Pipeline", "Stepper", "pipeline"]
