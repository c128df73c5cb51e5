"""The cluster's rank side: what every engine does at start (rank, device, process group), keeps (the registry)
and measures (memory), and the groups and meshes it forms. Runs on the engines."""
