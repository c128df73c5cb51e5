"""nbdist's two kinds of failure: the user asked for something impossible, or something failed on the engines."""


class DistUsageError(ValueError):
    """Bad input: the message names the problem in one line. Magics show it as an IPython UsageError."""


class DistError(RuntimeError):
    """A failure on the cluster (a rank raised, timed out or died); the message says which rank and what we did."""
