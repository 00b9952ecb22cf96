"""``ddpkit k8s`` and the rendezvous secret: never in clear in the manifest, each variable once, a
``/dev/shm`` within ``--memory``, and a Secret mounted so that the pod's containers, root or not,
read it and nobody else does; the reader accepts that mount exactly as a kubelet lays it out, and
nothing looser."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit._errors import ConfigError
from ddpkit._launch.cli import k8s
from ddpkit._launch.rendezvous import auth
from ddpkit._launch.rendezvous.auth import SECRET_ENV, SECRET_FILE_ENV, load_secret

SECRET = "0123456789abcdef0123456789abcdef"
IMAGE = ["--image", "reg/train:1"]


def _docs(args: list[str], capsys) -> list[dict]:
    assert k8s.main(["--dry-run", *IMAGE, *args, "train.py"]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def _env_lists(node) -> list[list[dict]]:
    """Every ``env`` list of the manifest (the containers', a TrainJob's trainer's)."""
    if isinstance(node, dict):
        found = [node["env"]] if isinstance(node.get("env"), list) else []
        return found + [lst for value in node.values() for lst in _env_lists(value)]
    if isinstance(node, list):
        return [lst for item in node for lst in _env_lists(item)]
    return []


def _leaks(docs: list[dict]) -> list[str]:
    """What a reader of the job would find wrong: the secret in clear, a name twice in one env
    list."""
    found = [f"secret in clear: {SECRET_ENV}" for doc in docs if SECRET in yaml.safe_dump(doc)]
    for env in (lst for doc in docs for lst in _env_lists(doc)):
        names = [entry["name"] for entry in env]
        found += [f"twice: {name}" for name in sorted(set(names)) if names.count(name) > 1]
    return found


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob", "jobset"])
@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            f"{SECRET_ENV}={SECRET}",
            f"--env {SECRET_ENV}=...: the manifest would hold the rendezvous secret in clear",
        ),
        (
            f"{SECRET_FILE_ENV}=/elsewhere",
            f"--env {SECRET_FILE_ENV}: ddpkit sets it to /etc/ddpkit/rdzv/rdzv-secret",
        ),
    ],
)
def test_env_refuses_the_secret_and_the_names_ddpkit_sets(kind, env, message, capsys):
    with pytest.raises(ConfigError, match=message) as info:
        k8s.main(["--dry-run", *IMAGE, "--kind", kind, "--nodes", "2", "--env", env, "train.py"])
    assert SECRET not in str(info.value)


def test_env_refuses_a_name_given_twice_and_keeps_distinct_ones(capsys):
    with pytest.raises(
        ConfigError, match="--env OMP_NUM_THREADS is given twice: give each name once"
    ):
        k8s.main(
            [
                "--dry-run",
                *IMAGE,
                "--env",
                "OMP_NUM_THREADS=4",
                "--env",
                "OMP_NUM_THREADS=8",
                "train.py",
            ]
        )
    # Control for the refusals: distinct names pass, and a one-node job sets no secret file of its
    # own.
    docs = _docs(["--nodes", "2", "--env", "OMP_NUM_THREADS=4", "--env", "NCCL_DEBUG=WARN"], capsys)
    assert _leaks(docs) == []
    assert _leaks(_docs(["--env", f"{SECRET_FILE_ENV}=/x"], capsys)) == []


def test_control_without_the_env_check_the_manifest_holds_the_secret_and_two_entries(
    capsys, monkeypatch
):
    # main's manifest, which took any --env: what the check above refuses is found by a reader of
    # the job.
    monkeypatch.setattr(k8s.ManifestConfig, "_check_env", lambda self: None)
    docs = _docs(
        ["--nodes", "2", "--env", f"{SECRET_ENV}={SECRET}", "--env", f"{SECRET_FILE_ENV}=/x"],
        capsys,
    )
    assert set(_leaks(docs)) == {f"secret in clear: {SECRET_ENV}", f"twice: {SECRET_FILE_ENV}"}


def _shm_over_memory(memory: str, shm: str) -> bool:
    return k8s.quantity("--shm-size", shm, whole=True) > k8s.quantity(
        "--memory", memory, whole=True
    )


@pytest.mark.parametrize("memory", ["1Ki", "1000", "1023Ki"])
def test_the_default_shm_is_checked_against_memory(memory):
    with pytest.raises(
        ConfigError, match=f"--memory {memory} is less than the default /dev/shm of 1Mi"
    ):
        k8s.ManifestConfig(script="t.py", image="i", memory=memory)
    # Control for the refusal: from 2Mi the default, half of it, fits; a --shm-size within it is
    # taken.
    assert k8s.ManifestConfig(script="t.py", image="i", memory="2Mi").shm_size == "1Mi"
    assert (
        k8s.ManifestConfig(script="t.py", image="i", memory=memory, shm_size=memory).shm_size
        == memory
    )


def test_control_mains_default_shm_was_larger_than_memory():
    half = k8s.quantity("--memory", "1Ki", whole=True) / 2
    # main's rule, unchecked
    mains_default = "8Gi" if half >= 8 * 2**30 else f"{max(1, int(half // 2**20))}Mi"
    assert _shm_over_memory("1Ki", mains_default)


def test_the_secret_is_mounted_0440_for_the_pods_fsgroup(capsys):
    for kind in ("trainjob", "pytorchjob", "jobset"):
        text = yaml.safe_dump(_docs(["--kind", kind, "--nodes", "2", "--fs-group", "3000"], capsys))
        assert "defaultMode: 288" in text and "fsGroup: 3000" in text, kind  # 288 == 0o440
    with pytest.raises(ConfigError, match="--fs-group 0: a group id"):
        k8s.main(["--dry-run", *IMAGE, "--nodes", "2", "--fs-group", "0", "train.py"])


# The secret's file as a kubelet writes a Secret volume (pkg/volume/util/atomic_writer.go): the keys
# are links to ..data/KEY, ..data a link to a folder of the write's time, the files root's with the
# defaultMode, and, with an fsGroup, the kubelet's SetVolumeOwnership gives them that group and adds
# 0440 (the volume is read-only).
FS_GROUP = 2000


def _kubelet_volume(top: Path, mode: int, group: int) -> Path:
    os.chmod(top, 0o755)
    dated = top / "..2024_11_25_21_00_00.123456789"
    dated.mkdir()
    os.chmod(dated, 0o2755)
    real = dated / k8s.SECRET_KEY
    real.write_text(SECRET)
    os.chown(real, 0, group)
    os.chmod(real, mode)
    (top / "..data").symlink_to(dated.name)
    (top / k8s.SECRET_KEY).symlink_to(f"..data/{k8s.SECRET_KEY}")
    return top / k8s.SECRET_KEY


root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="lays out root-owned files and starts another user"
)


@pytest.fixture
def top() -> Iterator[Path]:
    # /tmp: the other user can reach it
    base = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    yield base
    shutil.rmtree(base)


def _read_as(path: Path, uid: int, groups: list[int]) -> str:
    """load_secret in a process of a non-root container user, with ``groups`` as its supplementary
    groups (the pod's fsGroup, or none): a fork that drops root before it reads (a new interpreter,
    under /root, would not start as that user)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only calls into modules already imported, then leaves at once
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = "read " + load_secret(str(path), {}).decode()
            except ConfigError as err:
                out = f"refused: {err}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


@root_only
def test_a_non_root_container_with_the_fsgroup_reads_the_kubelets_file_and_another_user_cannot(top):
    path = _kubelet_volume(top, 0o440, FS_GROUP)
    assert _read_as(path, 1000, [FS_GROUP]) == f"read {SECRET}"
    other = _read_as(path, 1001, [])  # not of the pod: the mode keeps it out
    assert other.startswith("refused: ") and "Permission denied" in other, other


@root_only
def test_control_mains_mount_0400_without_an_fsgroup_is_unreadable_by_a_non_root_container(top):
    path = _kubelet_volume(top, 0o400, 0)  # defaultMode 0400, no fsGroup: root's file, root's group
    other = _read_as(path, 1000, [FS_GROUP])
    assert other.startswith("refused: ") and "Permission denied" in other, other


@root_only
def test_the_reader_accepts_exactly_the_kubelets_layout(top, tmp_path):
    assert load_secret(str(_kubelet_volume(top, 0o440, os.getegid())), {}) == SECRET.encode()
    refused = "can be read by other users"
    # World-readable (defaultMode 0444): refused.
    world = tmp_path / "world"
    world.mkdir()
    with pytest.raises(ConfigError, match=rf"{refused} \(mode 444\)"):
        load_secret(str(_kubelet_volume(world, 0o444, os.getegid())), {})
    # A group this process is not in: other users. Refused.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    with pytest.raises(ConfigError, match=rf"{refused} \(mode 440\)"):
        load_secret(str(_kubelet_volume(stranger, 0o440, FS_GROUP)), {})
    # The same file without the kubelet's links (a copy, the dated file named directly): refused.
    flat = tmp_path / "flat"
    flat.write_text(SECRET)
    os.chmod(flat, 0o440)
    for path in (flat, next(top.glob("..2024*")) / k8s.SECRET_KEY):
        with pytest.raises(ConfigError, match=refused):
            load_secret(str(path), {})


@root_only
def test_control_mains_reader_refuses_the_kubelets_0440_file(top, monkeypatch):
    # main's reader: any group or other bit refused, the kubelet's 0440 for this process's group
    # among them.
    monkeypatch.setattr(auth, "_kubelet_secret", lambda path, info: False)
    with pytest.raises(ConfigError, match=r"can be read by other users \(mode 440\)"):
        load_secret(str(_kubelet_volume(top, 0o440, os.getegid())), {})
