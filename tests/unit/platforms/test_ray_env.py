"""A Ray Train worker's variables, read as ddpkit reads them (the cluster itself:
tests/jobs/launch/test_ray.py)."""

from __future__ import annotations

from ddpkit.distributed._environment import read_launch_env

# What Ray Train 2.60 sets in a worker of a 2-worker run (ray/train/torch/config.py): torchrun's
# names, the node's rank, and the raylet's pid as in every Ray worker process.
RAY_WORKER = {
    "RANK": "1",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "1",
    "NODE_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "49337",
    "RAY_RAYLET_PID": "2912",
    "RAY_JOB_ID": "01000000",
}


def test_a_ray_train_worker_is_launcher_ray_with_its_ranks():
    info = read_launch_env(RAY_WORKER)
    assert (info.launcher, info.rank, info.local_rank, info.world_size, info.local_world_size) == (
        "ray",
        1,
        0,
        2,
        1,
    )


def test_torchrun_started_inside_a_ray_task_is_torchrun():
    """Control: the raylet's pid alone does not make Ray the launcher when torchrun's agent started
    the process."""
    assert read_launch_env(RAY_WORKER | {"TORCHELASTIC_RUN_ID": "x"}).launcher == "torchrun"
    assert (
        read_launch_env({k: v for k, v in RAY_WORKER.items() if not k.startswith("RAY_")}).launcher
        == "torchrun"
    )
