"""Where pdserve's HTTP servers listen: shared by `pdserve serve`, `pdserve proxy` and the
disaggregated launcher (which Host headers they answer is server/config.py's allowed_hosts)."""
import socket

from pdserve.errors import ConfigError


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
