"""How a rank waits, and so what a waiting rank costs the ranks sharing its cores: the MPI backend's rule
(backend/ranks/waiting.py polls by it) and the local predictor's (sharding/step_time.py prices shared cores by it).

A wait first tests without pause (a collective between ready ranks completes within microseconds), then yields
the core between tests, then sleeps between tests: only the first YIELD_SECONDS of a wait keep its core busy.
"""
from __future__ import annotations

SPIN_SECONDS = 50e-6  # pure spinning this long: a collective between ready ranks completes within it
YIELD_SECONDS = 5e-3  # then sched_yield between tests, then sleep NAP_SECONDS: a long wait leaves the core free
NAP_SECONDS = 200e-6
