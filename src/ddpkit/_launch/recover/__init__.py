"""In-place recovery (``ddpkit run --recover in-place``, docs/recovery.md)."""
