"""Pipeline parallelism: split a model into stages across ranks and run any schedule for real.

stages.py (cutting the model), executor.py (one rank's actions, on the engines), transport.py (P2P messages),
stepping.py (ticks), api.py (Pipeline and Stepper in the notebook).
"""
from nbdist.pipeline_parallel.api import Pipeline, Stepper, pipeline

__all__ = ["Pipeline", "Stepper", "pipeline"]
