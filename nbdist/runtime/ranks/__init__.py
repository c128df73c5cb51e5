"""The rank-side runtime: placement.py, memory.py, registry.py, devices.py, compat.py. Runs on the engines."""
