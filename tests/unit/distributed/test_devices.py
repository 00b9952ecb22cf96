"""What can be checked about the GPU without one: which device a rank and its tensors go to, which
backend it uses, that the loader pins and copies asynchronously for a GPU, that the CUDA generators
are part of a snapshot and of a sample's seeding, the live checks ``ddpkit env`` runs, how the bench
starts GPU jobs, and where ``--debug-collectives`` has nccl's flight recorder write.

CUDA itself is mocked here (pure logic); the same behaviour on a real GPU is tested in
test_gpu_*.py.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import ddpkit
import ddpkit.data
import ddpkit.distributed._seeding
from ddpkit._errors import ConfigError
from ddpkit._launch.cli.run import flight_recorder_vars
from ddpkit.data._loader import Held, seed_sample
from ddpkit.distributed._runtime import Runtime, _pick_backend, _pick_device
from ddpkit.distributed._seeding import rng_state, set_rng_state, stream_seed
from ddpkit.platforms._base import LaunchEnv
from ddpkit.training._config import LoggingConfig


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def cuda_in_use(monkeypatch):
    """This process "has initialised CUDA": its generators are recorded instead of touched."""
    calls: dict[str, list] = {"manual_seed": [], "set_rng_state": [], "set_rng_state_all": []}
    for module in (ddpkit.distributed._seeding, ddpkit.data._loader):
        monkeypatch.setattr(module, "cuda_in_use", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: calls["manual_seed"].append(s))
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7, 7], dtype=torch.uint8)
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda s, device="cuda": calls["set_rng_state"].append(s)
    )
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state_all",
        lambda: [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)],
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state_all", lambda states: calls["set_rng_state_all"].append(states)
    )
    return calls


def test_a_rank_goes_to_the_gpu_of_its_local_rank_and_talks_nccl_there(two_gpus):
    launch = LaunchEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, launcher="torchrun")
    device = _pick_device(launch, None)
    assert device == torch.device("cuda", 1) and _pick_backend(device, None) == "nccl"
    # A device asked for wins, and its backend follows it: CPU processes talk gloo on a GPU machine.
    assert (
        _pick_device(launch, "cpu") == torch.device("cpu")
        and _pick_backend(torch.device("cpu"), None) == "gloo"
    )
    # Control: nccl cannot move CPU tensors.
    with pytest.raises(ConfigError, match="backend 'nccl' cannot run collectives on cpu"):
        _pick_backend(torch.device("cpu"), "nccl")


def test_without_a_gpu_a_rank_is_a_cpu_process_over_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    launch = LaunchEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, launcher="torchrun")
    device = _pick_device(launch, None)
    assert device == torch.device("cpu") and _pick_backend(device, None) == "gloo"


def _runtime(device: str) -> Runtime:
    return Runtime(0, 0, 1, 1, torch.device(device), None)


@pytest.mark.parametrize("device,pinned", [("cuda:0", True), ("cpu", False)])
def test_the_loader_pins_batches_when_the_rank_trains_on_a_gpu(monkeypatch, device, pinned):
    for module in (ddpkit.data._loader, ddpkit.data._sampler):
        monkeypatch.setattr(module, "get_runtime", lambda group=None: _runtime(device))
    data = TensorDataset(torch.arange(8.0))
    assert ddpkit.data.build_loader(data, 2, num_workers=0).pin_memory is pinned
    assert ddpkit.data.build_eval_loader(data, 2, num_workers=0).pin_memory is pinned
    # Asked for, it is what was asked (control: the default is the device's).
    assert ddpkit.data.build_loader(data, 2, num_workers=0, pin_memory=False).pin_memory is False


def test_batches_go_to_a_gpu_without_blocking_and_to_the_cpu_as_they_are(monkeypatch):
    moves = []

    def to(self, device, non_blocking=False):
        moves.append((str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = {"x": torch.zeros(2), "y": (torch.ones(2), [torch.zeros(1)])}
    ddpkit.data.to_device(batch, torch.device("cuda", 0))
    assert moves == [("cuda:0", True)] * 3
    moves.clear()
    # control: a copy to the CPU is not asynchronous
    ddpkit.data.to_device(batch, torch.device("cpu"))
    assert moves == [("cpu", False)] * 3


def test_the_cuda_generators_are_part_of_the_rng_state_once_cuda_is_in_use(cuda_in_use):
    state = rng_state()
    assert [s.tolist() for s in state["cuda"]] == [[1, 2], [3, 4]]
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as in a snapshot's values.pt, read back with weights_only=True
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True))
    (restored,) = cuda_in_use["set_rng_state_all"]
    assert [s.tolist() for s in restored] == [[1, 2], [3, 4]] and all(
        s.device.type == "cpu" for s in restored
    )


def test_before_cuda_is_in_use_the_rng_state_has_no_cuda_part(monkeypatch):
    for module in (ddpkit.distributed._seeding, ddpkit.data._loader):
        monkeypatch.setattr(module, "cuda_in_use", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("CUDA touched"))
    assert "cuda" not in rng_state()


def test_a_trainer_snapshot_holds_every_ranks_cuda_generators(cuda_in_use, tmp_path):
    from ddpkit.training._trainer import Trainer, TrainerConfig

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    model = torch.nn.Linear(4, 2)
    config = TrainerConfig(
        run_dir=str(tmp_path), batch_size=4, num_workers=0, logging=LoggingConfig(progress=False)
    )
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config)
    state = trainer.state_dict()
    (rank0,) = state["states"]["rng"]["ranks"]
    assert [s.tolist() for s in rank0["rng"]["cuda"]] == [[1, 2], [3, 4]]
    state.pop("strategy")  # DCP's part; the rest is values.pt
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    trainer.load_state_dict(
        torch.load(buffer, weights_only=True) | {"strategy": trainer.strategy.state_dict()}
    )
    assert [[s.tolist() for s in states] for states in cuda_in_use["set_rng_state_all"]] == [
        [[1, 2], [3, 4]]
    ]


def test_a_sample_seeds_the_current_gpus_generator_where_cuda_is_in_use(cuda_in_use):
    seed_sample(5, 2, 11)
    assert cuda_in_use["manual_seed"] == [stream_seed("sample", 5, 2, 11)]
    held = Held()
    assert held.cuda.tolist() == [7, 7]
    held.put_back()
    held.release_numpy()
    assert [s.tolist() for s in cuda_in_use["set_rng_state"]] == [[7, 7]]


def test_a_process_without_cuda_in_use_leaves_the_gpu_alone(monkeypatch):
    # A forked loader worker of a GPU rank is such a process: CUDA would raise there.
    for module in (ddpkit.distributed._seeding, ddpkit.data._loader):
        monkeypatch.setattr(module, "cuda_in_use", lambda: False)
    for name in ("manual_seed", "get_rng_state", "set_rng_state"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail("CUDA touched"))
    seed_sample(5, 2, 11)
    held = Held()
    assert held.cuda is None
    held.put_back()
    held.release_numpy()


class _Indexed(Dataset):
    def __init__(self, draws: bool) -> None:
        self.draws = draws

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if self.draws:
            torch.rand(())  # an augmentation's draw
        return i


def test_each_sample_of_a_batch_seeds_the_gpu_and_the_batch_restores_it(cuda_in_use):
    it = iter(ddpkit.build_loader(_Indexed(draws=True), 4, seed=3, num_workers=0, pin_memory=False))
    next(it)  # the first batch that draws is read again, seeded: from now on every sample is seeded
    cuda_in_use["manual_seed"].clear()
    cuda_in_use["set_rng_state"].clear()
    batch = next(it)
    assert cuda_in_use["manual_seed"] == [stream_seed("sample", 3, 0, int(i)) for i in batch]
    # the training stream's state, put back after the batch
    assert len(cuda_in_use["set_rng_state"]) == 1
    # A dataset that draws nothing has nothing to seed and nothing to put back.
    cuda_in_use["manual_seed"].clear()
    cuda_in_use["set_rng_state"].clear()
    next(
        iter(ddpkit.build_loader(_Indexed(draws=False), 4, seed=3, num_workers=0, pin_memory=False))
    )
    assert cuda_in_use["manual_seed"] == [] and cuda_in_use["set_rng_state"] == []
    # Control: without per-sample seeding the loader leaves the GPU's generator to the dataset.
    loader = ddpkit.build_loader(
        _Indexed(draws=True), 4, seed=3, num_workers=0, pin_memory=False, seed_samples=False
    )
    next(iter(loader))
    assert cuda_in_use["manual_seed"] == []


def test_ddpkit_env_checks_gloo_everywhere_and_nccl_on_up_to_two_gpus():
    from ddpkit.tools._env import live_checks

    assert live_checks(0) == [("gloo", 2, "cpu")]
    # nccl refuses two processes on one GPU: one GPU gets a one-process check.
    assert live_checks(1) == [("gloo", 2, "cpu"), ("nccl", 1, None)]
    assert live_checks(8) == [("gloo", 2, "cpu"), ("nccl", 2, None)]


def test_the_bench_spawns_gpu_jobs_afresh_and_forks_cpu_ones(monkeypatch):
    from ddpkit.tools._bench import _start_method

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert _start_method() is None  # ddpkit.spawn's default: fork where it can


def test_the_all_reduce_span_on_a_gpu_is_read_from_cuda_events(monkeypatch):
    from ddpkit.tools._measure import _CommTimer

    class Event:
        clock = 0.0

        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            Event.clock += 2.5
            self.at = Event.clock

        def elapsed_time(self, end: Event) -> float:  # milliseconds, as CUDA events give them
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = _CommTimer(cuda=True)
    timer.first = timer._stamp()
    timer._stamp()
    timer.last = timer._stamp()
    assert timer.take() == pytest.approx(5e-3)
    assert timer.take() == 0.0  # control: nothing all-reduced since


def test_debug_collectives_asks_for_the_flight_recorder():
    from ddpkit._launch.cli.options import LaunchConfig
    from ddpkit._launch.cli.run import worker_env

    buffer, _ = flight_recorder_vars()
    env = worker_env(LaunchConfig(script="t.py", debug_collectives=True), 2)
    assert env[buffer] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    control = worker_env(LaunchConfig(script="t.py"), 2)
    assert not {buffer, "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_DISTRIBUTED_DEBUG"} & set(control)


def test_spawn_starts_new_interpreters_once_the_autograd_engine_has_device_threads(monkeypatch):
    # On a machine with a GPU, the first backward starts the autograd engine's device threads
    # (pt_autograd_<device>): a forked child's backward then fails. Here a thread takes that name.
    import threading

    from ddpkit._internals.compiler import autograd_device_threads
    from ddpkit._internals.interpreter import prctl
    from ddpkit.distributed import _spawn as spawn

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("thread names are read from /proc/self/task")
    assert not autograd_device_threads()  # control: no such thread here (a CPU build)
    assert spawn._start_method(None, None, 2)[0] == "fork"
    named, done = threading.Event(), threading.Event()

    def device_thread() -> None:
        prctl(15, "pt_autograd_0")  # PR_SET_NAME: this thread's name
        named.set()
        done.wait()

    thread = threading.Thread(target=device_thread)
    thread.start()
    try:
        named.wait()
        assert autograd_device_threads()
        assert spawn._start_method(None, None, 2)[0] == "spawn"
    finally:
        done.set()
        thread.join()
