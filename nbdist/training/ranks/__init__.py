"""The Trainer's loop on the ranks: batches, steps, the step-boundary agreement, synchronisers, checkpoints,
telemetry. Runs on the engines."""
