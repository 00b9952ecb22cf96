"""torchrun's elastic agent as ``ddpkit run`` runs it (:mod:`.agent`), the fork server its workers
start from (:mod:`.forkserver`), the worker's own side (:mod:`.worker`) and the failure summary
(:mod:`.failure`)."""
