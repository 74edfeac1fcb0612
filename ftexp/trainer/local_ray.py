"""Starting a private Ray instance that talks only to its own node.

``ray.init`` binds every Ray socket to the node IP it is given (loopback on one host, see
``ftexp/__init__.py``). One Ray process reaches further on its own: the dashboard process, which
Ray starts even with ``include_dashboard=False``, asks the cloud metadata service which cloud it
runs on (HTTP to 169.254.169.254 and metadata.google.internal) whether or not usage statistics are
enabled, and no Ray option skips that. The probe uses ``requests``, which honours ``http_proxy``;
so the dashboard alone is started with its proxy set to a closed loopback port, where every probe
is refused at once. The other Ray processes, the workers and the driver keep their environment.

Ray decides at its import whether a single node advertises the host's address or loopback, from an
environment variable that importing ``ftexp`` sets. A process that imported Ray first would start a
GCS on the host's address, so a loopback start refuses to run there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import ray
import ray._private.ray_constants as ray_constants
import ray._private.services as ray_services

from ftexp.environment import environment_set

log = logging.getLogger(__name__)

# Where the dashboard's HTTP requests go instead: port 1 on loopback has no listener (it is the
# reserved tcpmux port); should one listen, the probe still stays on loopback.
DASHBOARD_HTTP_PROXY = "http://127.0.0.1:1"
_PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY")


@contextlib.contextmanager
def dashboard_behind_closed_proxy(node_ip: str) -> Iterator[None]:
    """While Ray starts: its dashboard process (and only it) inherits a proxy on a closed loopback port.

    Ray spawns the dashboard from ``services.start_api_server`` with the caller's environment, so
    the environment is changed for the length of that call only. Its own gRPC to the GCS ignores
    the proxy (Ray turns gRPC's proxy support off), and ``no_proxy`` keeps anything it sends to its
    node direct."""
    start_api_server = ray_services.start_api_server
    proxy = {name: DASHBOARD_HTTP_PROXY for name in _PROXY_VARIABLES}
    proxy["no_proxy"] = proxy["NO_PROXY"] = ",".join(dict.fromkeys(["127.0.0.1", "localhost", node_ip]))

    def start_api_server_behind_proxy(*args, **kwargs):
        with environment_set(proxy):
            return start_api_server(*args, **kwargs)

    ray_services.start_api_server = start_api_server_behind_proxy
    try:
        yield
    finally:
        ray_services.start_api_server = start_api_server


def start_local_ray(num_cpus: int, node_ip: str = "127.0.0.1", resources: dict[str, float] | None = None,
                    log_to_driver: bool = True) -> None:
    """A private Ray instance whose every socket is on ``node_ip``: loopback, unless a baseline's rollout
    node on a real cluster serves its engines on the node's own address.

    Ray gives its raylet a fixed 30 s to register; on an overloaded machine it sometimes needs more,
    and a second start then succeeds. So one failed start is retried."""
    if node_ip.startswith("127.") and ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(f"ray was imported before ftexp, so its GCS would listen on the host's address, not on "
                           f"{node_ip}: import ftexp first (it sets {ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR}=0)")
    for attempt in (1, 2):
        try:
            with dashboard_behind_closed_proxy(node_ip):
                ray.init(address="local", _node_ip_address=node_ip, include_dashboard=False, num_cpus=num_cpus,
                         resources=resources, log_to_driver=log_to_driver, configure_logging=False)
            return
        except Exception as e:  # Ray raises a bare Exception for this timeout
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            log.warning("ray did not start (%s); starting it again", e)
            ray.shutdown()
