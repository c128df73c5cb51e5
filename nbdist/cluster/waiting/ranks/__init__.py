"""A rank's side of waiting: the inspector thread that says what the rank is doing when the kernel asks, and the
device synchronisation a waiting rank does. Runs on the engines."""
