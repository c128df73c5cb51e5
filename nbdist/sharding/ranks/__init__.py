"""A sharded model on a rank: build it (DDP, ZeRO, TP), step it, gather it. Runs on the engines."""
