"""Command lines of the sglang router and of real sglang servers; the router's start-up refusals."""

from __future__ import annotations

import socket

import pytest

from ftexp.rollout import router as router_module
from ftexp.rollout.processes import free_port
from ftexp.rollout.router import Router
from ftexp.rollout.sglang_launcher import SglangServerSpec, command


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_sglang_server_command_line():
    spec = SglangServerSpec(model_path="/models/qwen3", port=30001, base_gpu_id=2, tp_size=2)
    args = command(spec)
    assert args[1:3] == ["-m", "sglang.launch_server"]
    assert (_value(args, "--model-path"), _value(args, "--host"), _value(args, "--port")) == \
        ("/models/qwen3", "127.0.0.1", "30001")
    assert (_value(args, "--base-gpu-id"), _value(args, "--tp-size")) == ("2", "2")
    assert "--enable-deterministic-inference" in args and _value(args, "--attention-backend") == "flashinfer"
    assert "--tokenizer-path" not in args and "--mem-fraction-static" not in args
    assert spec.url == "http://127.0.0.1:30001"
    other = command(SglangServerSpec(model_path="/m", port=1, tokenizer_path="/tok", mem_fraction_static=0.7,
                                     deterministic=False, extra_args=("--enable-metrics",)))
    assert _value(other, "--tokenizer-path") == "/tok" and _value(other, "--mem-fraction-static") == "0.7"
    assert "--enable-deterministic-inference" not in other and other[-1] == "--enable-metrics"


def test_router_command_line_stays_on_loopback(tmp_path):
    args = Router().command(["http://127.0.0.1:1", "http://127.0.0.1:2"], tmp_path, port=5, metrics_port=6)
    assert args[1:3] == ["-m", "sglang_router.launch_router"]
    assert (_value(args, "--host"), _value(args, "--port")) == ("127.0.0.1", "5")
    assert (_value(args, "--prometheus-host"), _value(args, "--prometheus-port")) == ("127.0.0.1", "6")
    assert args[args.index("--worker-urls") + 1:args.index("--worker-urls") + 3] == ["http://127.0.0.1:1",
                                                                                      "http://127.0.0.1:2"]
    assert _value(args, "--tokenizer-path") == str(tmp_path.resolve()) and _value(args, "--policy") == "round_robin"


def test_router_refuses_a_directory_without_tokenizer(tmp_path):
    router = Router()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        router.start(["http://127.0.0.1:1"], tmp_path)
    assert router.process is None


def test_router_not_ready_without_healthy_workers_is_stopped(model_dir):
    router = Router(startup_timeout_s=3)
    # Usually "(insufficient healthy workers)"; on a loaded machine the router may not answer at all yet.
    with pytest.raises(RuntimeError, match=r"not ready within 3 s \((insufficient healthy workers|ConnectError)\)"):
        router.start([f"http://127.0.0.1:{free_port()}"], model_dir)  # nothing listens there
    assert router.process is None and router.url is None


def _held_port_first(monkeypatch, times: int):
    """free_port hands out a port another socket holds, ``times`` times, then free ones."""
    held = socket.create_server(("127.0.0.1", 0))
    picks = iter([held.getsockname()[1]] * times)
    monkeypatch.setattr(router_module, "free_port", lambda: next(picks, None) or free_port())
    return held


def test_a_router_port_taken_before_it_binds_is_retried_on_new_ports(model_dir, tmp_path, monkeypatch):
    held = _held_port_first(monkeypatch, times=1)
    router = Router(startup_timeout_s=3, log_path=tmp_path / "router.log")
    with held, pytest.raises(RuntimeError, match="not ready within 3 s"):  # past the taken port: no worker listens
        router.start([f"http://127.0.0.1:{free_port()}"], model_dir)
    assert (tmp_path / "router.log").read_text().count("Address already in use") >= 1
    assert router.process is None


def test_a_router_whose_ports_stay_taken_fails_naming_it(model_dir, tmp_path, monkeypatch):
    held = _held_port_first(monkeypatch, times=2 * router_module.PORT_ATTEMPTS)
    router = Router(startup_timeout_s=10, log_path=tmp_path / "router.log")
    with held, pytest.raises(RuntimeError, match="ports were taken at start 3 times"):
        router.start([f"http://127.0.0.1:{free_port()}"], model_dir)
    assert router.process is None
