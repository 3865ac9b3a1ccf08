"""The loop (the controller) and what it drives: checkpoints, snapshots, weight updates, the SFT
warm-start, interrupts, progress and the metric log."""
