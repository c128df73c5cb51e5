"""Sharding a model over data, pipeline and tensor parallelism (and ZeRO): the plan, and what it will cost."""
