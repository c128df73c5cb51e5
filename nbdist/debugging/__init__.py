"""Debugging where it runs: why a cell hangs, and (next) where a pipeline's idle time comes from.

hang.py     explain(): the ranks' reports side by side, one table and one sentence (Cluster.why, %dist_why, and
            the view a timed-out or interrupted cell shows)
ranks/      recorder.py: the flight recorder every communication call writes into, on the engines; what the rank's
            inspector thread (cluster/waiting/ranks/inspector.py) reads when asked
"""
