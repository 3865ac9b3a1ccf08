"""Weight sync for torch backends: the transports (a broadcast group, CUDA IPC in place), the
checksum both sides compare, and the trainer's and engine's halves (`sender`, `receiver`)."""
