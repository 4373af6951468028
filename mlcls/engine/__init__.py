"""Training engine: devices and processes, the training loop, checkpoints and logging."""
