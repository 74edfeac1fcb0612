"""Starting the private Ray instance: a start that times out while its raylet registers is retried once,
any other failure is not; Ray's dashboard sends its cloud probe to a loopback proxy, which no other
process inherits; and a process that imported Ray before ftexp is refused a loopback start."""

import os
import socket
import subprocess
import sys

import pytest
import ray

from ftexp.trainer import local_ray


class FlakyInit:
    def __init__(self, *failures: Exception):
        self.failures, self.calls = list(failures), 0

    def __call__(self, **kwargs):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)


TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet failed")


def test_a_startup_timeout_is_retried_once(monkeypatch):
    init = FlakyInit(TIMEOUT)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    local_ray.start_local_ray(num_cpus=2)
    assert init.calls == 2


def test_a_second_timeout_or_another_error_is_raised(monkeypatch):
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "init", FlakyInit(TIMEOUT, TIMEOUT))
    with pytest.raises(Exception, match="timed out during startup"):
        local_ray.start_local_ray(num_cpus=2)
    init = FlakyInit(ValueError("bad resources"))
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError):
        local_ray.start_local_ray(num_cpus=2)
    assert init.calls == 1


def _proxy_variables() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.lower().endswith("_proxy")}


def test_the_dashboard_alone_sends_its_cloud_probe_to_the_loopback_proxy(monkeypatch):
    before = _proxy_variables()
    with socket.create_server(("127.0.0.1", 0)) as proxy:
        monkeypatch.setattr(local_ray, "DASHBOARD_HTTP_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        proxy.settimeout(60)
        local_ray.start_local_ray(num_cpus=1, log_to_driver=False)
        try:
            connection, _ = proxy.accept()
            with connection:
                request_line = connection.recv(4096).split(b"\r\n")[0]
            # what would otherwise have left the machine: the metadata address, asked through the proxy
            assert request_line.startswith(b"GET http://169.254.169.254/"), request_line
            assert _proxy_variables() == before

            @ray.remote
            def proxy_variables_of_a_worker() -> dict[str, str]:  # defined here: the worker cannot import tests
                return {name: value for name, value in os.environ.items() if name.lower().endswith("_proxy")}

            assert ray.get(proxy_variables_of_a_worker.remote()) == before
        finally:
            ray.shutdown()


def test_a_process_that_imported_ray_before_ftexp_is_refused_a_loopback_start():
    """Ray, imported first, would advertise the host's address; the refusal comes before any Ray process starts."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    code = ("import ray\n"
            "from ftexp.trainer.local_ray import start_local_ray\n"
            "start_local_ray(num_cpus=1)\n"
            "print('started')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "started" not in proc.stdout
    assert "ray was imported before ftexp" in proc.stderr
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in proc.stderr
