"""Tools over the training primitives: ``ddpkit bench`` (will more GPUs help?) and ``ddpkit check`` (do N ranks
train the same model as one process?). Nothing below ``ddpkit.tools`` imports from here."""
