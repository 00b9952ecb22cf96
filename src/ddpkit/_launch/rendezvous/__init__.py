"""What each node of a multi-node job tells torchrun about itself, worked out from the endpoint with
the kernel's routing: whether it hosts the rendezvous, its address as the others reach it, and the
interface that carries it."""

from __future__ import annotations

import errno
import fcntl
import socket
import struct
import time
from dataclasses import dataclass

from ddpkit._errors import ConfigError

_SIOCGIFADDR = 0x8915  # from <linux/sockios.h>


@dataclass(frozen=True)
class NodeAddress:
    """What this node tells torchrun about itself for one rendezvous endpoint."""

    host: str
    port: int
    host_ip: str  # HOST's IPv4 address
    is_host: bool  # this node owns host_ip: its agent serves the rendezvous store
    local_addr: str  # this node's address on the route towards host_ip
    interface: str | None  # the interface that carries local_addr (None: not told)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: use HOST:PORT, for example node1:29400")
    return host.strip("[]"), int(port)


def resolve(host: str) -> str:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as err:
        raise ConfigError(
            f"--rdzv-endpoint host {host!r} cannot be resolved ({err.strerror}): use a host name "
            "every node can resolve, or the IP address of the node that hosts the rendezvous"
        ) from None


def is_local_address(ip: str) -> bool:
    """True when ``ip`` belongs to an interface of this machine (binding to it succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                return False
            raise


def route_source(ip: str, port: int) -> str:
    """The local address the kernel would send from to reach ``ip`` (a UDP connect: no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))
        except OSError as err:
            raise ConfigError(
                f"no route from this node to the rendezvous host {ip} ({err.strerror}): check "
                "--rdzv-endpoint and this node's network"
            ) from None
        return s.getsockname()[0]


def interface_of(ip: str) -> str | None:
    """The interface whose IPv4 address is ``ip``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def node_address(endpoint: str) -> NodeAddress:
    """What this node tells torchrun for ``endpoint`` (a ConfigError for a bad one)."""
    host, port = split_endpoint(endpoint)
    host_ip = resolve(host)
    local = is_local_address(host_ip)
    source = host_ip if local else route_source(host_ip, port)
    # of several agents on the endpoint's machine, the first to start hosts the store
    hosting = local and not _listening(host_ip, port)
    return NodeAddress(host, port, host_ip, hosting, source, interface_of(source))


def _listening(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((ip, port)) == 0


def wait_reachable(ip: str, port: int, timeout: float) -> None:
    """Wait until something accepts connections at ``ip:port``, or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConfigError(
                f"the rendezvous at {ip}:{port} did not answer within {timeout:.0f} s ({last}): "
                f"start `ddpkit run` with the same --rdzv-endpoint on the node that owns {ip} (it "
                "hosts the rendezvous), check that --rdzv-endpoint names that node, and that no "
                "firewall blocks the port; --join-timeout sets how long to wait"
            )
        try:
            with socket.create_connection((ip, port), timeout=min(2.0, left)):
                return
        except ConnectionRefusedError:
            last = "connection refused: nothing listens there yet"
        except TimeoutError:
            last = "no reply: wrong address, or a firewall dropping packets"
        except OSError as err:
            last = err.strerror or str(err)
            if err.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                raise ConfigError(
                    f"the rendezvous host {ip} is unreachable ({last}): check --rdzv-endpoint"
                ) from None
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
