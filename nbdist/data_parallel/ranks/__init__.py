"""DDP on any group, its compression hooks, a plain gradient average. Runs on the engines."""
