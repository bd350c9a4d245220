"""Where pdserve's HTTP servers listen and which Host headers they answer: shared by `pdserve
serve`, `pdserve proxy` and the disaggregated launcher."""
import argparse
import socket

from pdserve.errors import ConfigError

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Names that always reach a server bound to loopback, whatever --host says.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """--allowed-hosts, or its default; None means any Host."""
    if args.allowed_hosts is not None:
        return None if "*" in args.allowed_hosts else args.allowed_hosts
    if args.host in WILDCARD_HOSTS:   # every interface: names this machine goes by are not known here
        return None
    return list(dict.fromkeys([args.host, *LOCAL_HOSTS]))


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port is reported at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
