"""Snapshots: folders written with torch.distributed.checkpoint, their storage, the run directory's files, and the best weights."""
