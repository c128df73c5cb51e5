"""Debugging on the ranks: the flight recorder every communication call writes into. Runs on the engines."""
