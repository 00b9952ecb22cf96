"""Starting a job: ``ddpkit run`` over torchrun's elastic agent, its rendezvous, the workers, SLURM batch scripts, and ``spawn`` for notebooks."""
