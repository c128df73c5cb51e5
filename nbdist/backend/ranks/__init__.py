"""The MPI process group for torch, its requests and buffers. Runs on the engines."""
