"""The torch version gate, and the store a launcher serves on a socket it bound itself, on every
torch."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpkit._errors import ConfigError
from ddpkit._internals import store, versions


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.6.0+cu124", (2, 6)),
        ("2.13.0", (2, 13)),
        ("2.16.0a0+git1234abc", (2, 16)),
        ("3.0.0.dev20270101", (3, 0)),
    ],
)
def test_the_torch_version_is_parsed_from_release_local_and_nightly_strings(
    text: str, expected: tuple[int, int]
) -> None:
    assert versions.parse_version(text) == expected


def test_a_version_string_without_major_and_minor_is_refused() -> None:
    with pytest.raises(ValueError, match="not a torch version"):
        versions.parse_version("nightly")


def test_a_feature_above_the_installed_torch_is_refused_naming_both_versions() -> None:
    newer = (versions.TORCH_VERSION[0], versions.TORCH_VERSION[1] + 1)
    with pytest.raises(ConfigError) as err:
        versions.require_torch("the frobnicator", newer, instead="set frobnicate=False")
    text = str(err.value)
    assert (
        "the frobnicator" in text and f"{newer[0]}.{newer[1]}" in text and torch.__version__ in text
    )
    assert "set frobnicate=False" in text
    versions.require_torch("the frobnicator", versions.TORCH_VERSION)  # the installed one: no error
    assert versions.torch_at_least(versions.FLOOR) and not versions.torch_at_least(newer)


def _listener() -> tuple[int, int]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    port = listener.getsockname()[1]
    return listener.detach(), port


def test_the_store_serves_on_the_socket_it_is_handed_and_a_default_client_reaches_it() -> None:
    fd, port = _listener()
    master = store.serve_store(fd, "127.0.0.1", port, timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert master.get("k") == b"v"
    assert master.port == port


@pytest.mark.skipif(
    versions.torch_at_least(store.LIBUV_LISTEN_FD),
    reason="this torch's libuv backend serves on a handed socket",
)
def test_below_its_version_libuv_refuses_a_handed_socket_which_is_why_the_gate_exists() -> None:
    fd, port = _listener()
    try:
        with pytest.raises(NotImplementedError, match="listen fd"):
            dist.TCPStore(
                "127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd
            )
    finally:
        socket.socket(fileno=fd).close()


def test_the_agent_store_variable_is_set_and_read_as_torchs_rendezvous_reads_it(
    monkeypatch,
) -> None:
    import importlib

    rendezvous = importlib.import_module(
        "torch.distributed.rendezvous"
    )  # the module, not its function
    environ: dict[str, str] = {}
    monkeypatch.setattr(os, "environ", environ)  # torch reads os.environ at each call
    assert not rendezvous._torchelastic_use_agent_store()
    store.use_agent_store(environ)
    assert environ == {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert rendezvous._torchelastic_use_agent_store()


def test_every_store_internal_holds_on_this_torch() -> None:
    from ddpkit._internals.contract import problem

    assert [problem(i) for i in store.INTERNALS] == [None] * len(store.INTERNALS)
