"""Data parallelism: replicas of one model, their gradients averaged (DDP, its communication hooks, a plain average).
All of it runs on the engines (ranks/); sharding/ and the Trainer apply it."""
