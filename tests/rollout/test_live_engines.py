"""Engines as Ray actors (each serving from a process forked for it) behind the real sglang router, and a
sender pushing weights to them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import psutil  # noqa: E402  (Ray ships psutil and puts it on sys.path)
from loopback_probe import descendants, foreign_sockets, socket_listing
from rollout.tiny_model import PROMPT, random_weights

from ftexp.rollout.client import EngineClient, SamplingParams
from ftexp.forkserver import forkserver
from ftexp.rollout.engine import ENGINE_PRELOAD, EngineGroup, EngineGroupConfig
from ftexp.rollout.router import Router
from ftexp.rollout.server_config import ServerConfig
from ftexp.rollout.weight_sync import WeightSender, engine_checksums, tensor_checksums
from ftexp.trainer.local_ray import start_local_ray


def _sampling(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=8, sampling_seed=seed)


@pytest.fixture(scope="module")
def fork_server():
    with forkserver(ENGINE_PRELOAD) as address:  # the engines' processes fork from it
        start_local_ray(num_cpus=2, log_to_driver=False)
        try:
            yield address
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def engines(fork_server, model_dir):
    group = EngineGroup(ServerConfig(str(model_dir)), EngineGroupConfig(num_engines=2))
    try:
        started = time.monotonic()
        group.start()
        print(f"\n2 engine actors started and healthy in {time.monotonic() - started:.1f} s")
        yield group
    finally:
        group.stop()


@pytest.fixture(scope="module")
def router(engines, model_dir):
    router = Router()
    try:
        router.start(engines.urls, model_dir)
        print(f"router started in {router.start_seconds:.2f} s")
        yield router
    finally:
        router.stop()


def test_engines_in_separate_processes_sample_alike(engines):
    pids = engines.pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    # Each serves from a process the node's fork server forked for it, not from its actor's.
    server = psutil.Process(pids[0]).parent()
    assert "ftexp.forkserver" in " ".join(server.cmdline()) and server.ppid() == os.getpid()
    a, b = (EngineClient(url) for url in engines.urls)
    assert a.generate(PROMPT, _sampling(1)).output_ids == b.generate(PROMPT, _sampling(1)).output_ids
    assert a.generate(PROMPT, _sampling(1)).output_ids != a.generate(PROMPT, _sampling(2)).output_ids


def test_router_serves_generate_like_the_engines(engines, router):
    seeds = range(8)
    through_router = EngineClient(router.url)
    with ThreadPoolExecutor(4) as pool:
        routed = list(pool.map(lambda s: through_router.generate(PROMPT, _sampling(s)).output_ids, seeds))
    direct = [EngineClient(engines.urls[0]).generate(PROMPT, _sampling(s)).output_ids for s in seeds]
    assert routed == direct and len(set(map(tuple, routed))) > 1


def test_a_sender_process_updates_the_actor_engines(engines, router, weight_shapes):
    through_router = EngineClient(router.url)
    before = through_router.generate(PROMPT, _sampling(3)).output_ids
    weights = random_weights(weight_shapes, seed=5)
    sender = WeightSender(timeout_s=30)
    try:
        sender.connect(engines.urls, "live_1")
        sender.send(weights, weight_version="rollout_0")
    finally:
        sender.close()
    assert engine_checksums(engines.urls) == [tensor_checksums(weights)] * 2
    after = [through_router.generate(PROMPT, _sampling(3)).output_ids for _ in range(2)]  # round robin: both engines
    assert after[0] == after[1] != before


def test_router_and_engines_use_only_loopback(engines, router):
    EngineClient(router.url).generate(PROMPT, _sampling(4))  # router <-> engine connections are open
    pids = descendants(router.pid) | set(engines.pids()) | {os.getpid()}
    out = socket_listing()
    owners = [line for line in out.splitlines() if f"pid={router.pid}," in line]
    assert any("LISTEN" in line for line in owners), "the probe saw no socket of the router"
    assert any(f"pid={pid}," in out for pid in engines.pids()), "the probe saw no socket of an engine"
    assert foreign_sockets(pids, out) == []


def test_simulated_crash_stops_serving_but_not_the_actor(engines):
    # Last in this module: it takes engine 1 down for good.
    actor, url = engines.actors[1], engines.urls[1]
    ray.get(actor.simulate_crash.remote(), timeout=30)
    assert not EngineClient(url).is_healthy()
    assert ray.get(actor.pid.remote(), timeout=10) > 0


def test_an_engines_process_dies_with_its_actor(fork_server, model_dir):
    group = EngineGroup(ServerConfig(str(model_dir)), EngineGroupConfig(num_engines=1))
    try:
        group.start()
        (pid,) = group.pids()
        ray.kill(group.actors[0], no_restart=True)
        try:
            psutil.Process(pid).wait(timeout=30)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            pytest.fail("the engine's process outlived its actor")
    finally:
        group.stop()


def test_an_actor_dies_with_its_engines_process(fork_server, model_dir):
    group = EngineGroup(ServerConfig(str(model_dir)), EngineGroupConfig(num_engines=1))
    try:
        group.start()
        (pid,) = group.pids()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the actor's keeper ends it a moment after the process died
                ray.get(group.actors[0].pid.remote(), timeout=10)
                time.sleep(0.1)
    finally:
        group.stop()


def test_the_loopback_probe_can_fail():
    """A socket listening on every interface is reported (the check above is not vacuous)."""
    probe = subprocess.Popen([sys.executable, "-c", "import socket, time\n"
                              "s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while not foreign_sockets({probe.pid}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert foreign_sockets({probe.pid}) != []
    finally:
        probe.kill()
        probe.wait()
