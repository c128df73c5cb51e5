"""Code that runs on the engines (one process per MPI rank). The notebook kernel never imports torch.cuda."""
