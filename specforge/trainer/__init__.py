"""Training: the TTT loss, the training loop, distributed setup, checkpoints (EAGLE-3 training
issue)."""
