"""Where the local Ray instance that `pdserve serve --ray` starts listens (docs/RAY.md, "Which
ports listen where").

Ray binds its servers (GCS, raylet, object manager, every worker's gRPC port, the agents) to its
node IP. On Linux that is the host's outgoing address, and a loopback one given to ray.init is
replaced by it (services.resolve_ip_for_localhost), unless Ray runs as it does on macOS and
Windows, a machine of its own: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read once when Ray is
imported, by this process and by every process Ray starts. So a loopback --host makes the node IP
loopback that way; another address --host names becomes the node IP; a wildcard one (0.0.0.0,
::) leaves Ray's choice. A cluster given by --ray-address was bound by its own `ray start`.
"""
import ipaddress
import os

LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_ip_for(host: str) -> str | None:
    """The node IP a local Ray instance should have for --host, or None for Ray's own choice."""
    if is_loopback(host):
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:   # a host name: Ray resolves its node IP itself
        return None
    return None if ip.is_unspecified else str(ip)


def local_ray_options(host: str) -> dict:
    """ray.init's options for a local instance that listens on `host` (and, for loopback, the
    environment its processes inherit)."""
    node_ip = node_ip_for(host)
    if node_ip is None:
        return {}
    if node_ip == "127.0.0.1":
        from ray._private import ray_constants
        os.environ[LOCAL_ONLY_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False   # this process imported Ray before the variable was set
    return {"_node_ip_address": node_ip}
