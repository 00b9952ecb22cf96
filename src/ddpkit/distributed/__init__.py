"""The distributed runtime: who this process is, the environment a launcher gave it, collectives, rank-aware printing, seeding and stop signals."""
