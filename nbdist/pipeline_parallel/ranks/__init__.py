"""A rank's pipeline stage: its entry points, the executor of its actions, point-to-point transport and clocks.
Runs on the engines."""
