"""What Kubernetes' operators set in a pod: the environments the tests of ddpkit's reading of them
share."""

POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
# A PyTorchJob worker pod of 1 master + 2 workers, one process each, as training-operator v1.9 sets
# it (pkg/controller.v1/pytorch/envvar.go, master.go): the master's service as MASTER_ADDR, RANK 1 +
# the worker's index, WORLD_SIZE pods x nprocPerNode, and the PET_* names of the same values.
PYTORCHJOB_WORKER = POD | {
    "PYTHONUNBUFFERED": "1",
    "MASTER_PORT": "23456",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "digits-master-0",
    "PET_MASTER_ADDR": "digits-master-0",
    "WORLD_SIZE": "3",
    "RANK": "2",
    "PET_NODE_RANK": "2",
    "PET_NNODES": "3",
}
# A TrainJob node of the torch-distributed runtime: torchrun's options as PET_* (Trainer v2's torch
# plugin, pkg/runtime/framework/plugins/torch/torch.go: the node rank from the Job's completion
# index, port 29500).
TRAINJOB_NODE = POD | {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "1",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "digits-node-0-0.digits",
    "PET_MASTER_PORT": "29500",
    "JOB_COMPLETION_INDEX": "1",
}
# A PyTorchJob with an elastic policy: c10d rendezvous at the first worker's service.
ELASTIC_WORKER = POD | {
    "PET_RDZV_BACKEND": "c10d",
    "PET_RDZV_ENDPOINT": "digits-worker-0:29400",
    "PET_RDZV_ID": "digits",
    "PET_NNODES": "1:3",
    "PET_NPROC_PER_NODE": "2",
    "PET_MAX_RESTARTS": "3",
}
