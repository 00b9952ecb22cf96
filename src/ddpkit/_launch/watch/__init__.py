"""The stall watch: each node's agent reads its ranks' progress records (:mod:`.stall`) and judges
the job's ranks by one rule (:mod:`.verdict`)."""
