"""What a run records: metrics files, progress, experiment trackers, and curves."""
