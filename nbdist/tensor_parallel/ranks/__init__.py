"""Splitting a stage's Linear pairs over the tp group with DTensor. Runs on the engines."""
