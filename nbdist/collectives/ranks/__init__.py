"""Collectives on the ranks: hand-built all-reduce algorithms and the timing loops of the benchmark. Runs on the engines."""
