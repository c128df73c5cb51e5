"""The one source of prices: collective costs (steps and bytes per algorithm) and hardware profiles. Plain data:
the local predictor, the planner and the labs all read it."""
