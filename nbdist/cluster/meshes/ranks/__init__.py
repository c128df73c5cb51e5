"""A mesh on a rank: its process groups and MPI communicators (rank_mesh.py), groups by rank list (groups.py). Runs
on the engines."""
