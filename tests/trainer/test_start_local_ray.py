"""A Ray start that times out while its raylet registers is retried once; any other failure is not."""

import pytest
import ray

from ftexp.trainer import driver


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
    driver.start_local_ray(num_cpus=2)
    assert init.calls == 2


def test_a_second_timeout_or_another_error_is_raised(monkeypatch):
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "init", FlakyInit(TIMEOUT, TIMEOUT))
    with pytest.raises(Exception, match="timed out during startup"):
        driver.start_local_ray(num_cpus=2)
    init = FlakyInit(ValueError("bad resources"))
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError):
        driver.start_local_ray(num_cpus=2)
    assert init.calls == 1
