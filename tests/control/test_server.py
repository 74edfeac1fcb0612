"""The control server over real HTTP on 127.0.0.1: every endpoint, status code and body."""

import httpx
import pytest

from ftexp.control.api_models import TriState
from ftexp.control.registry import CellRegistry, compute_cell_status
from ftexp.control.server import ControlServer
from ftexp.errors import InputError
from ftexp.control.failure_modes import FailureMode

from .scripted_cells import ScriptedCell, serve


def condition(type_, status, reason=None):
    return {"type": type_, "status": status, "reason": reason, "message": None, "lastTransitionTime": None}


def golden_cell(name, cell_type, index, suspend, phase, conditions):
    return {
        "apiVersion": "miles.io/v1",
        "kind": "Cell",
        "metadata": {"name": name, "labels": {"miles.io/cell-type": cell_type, "miles.io/cell-index": str(index)}},
        "spec": {"suspend": suspend},
        "status": {"phase": phase, "conditions": conditions},
    }


def k8s_status(code, reason, message):
    return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "message": message, "reason": reason,
            "code": code}


ALIVE_HEALTHY = [condition("Allocated", "True"), condition("Healthy", "True"), condition("Initialized", "True")]


@pytest.fixture
def cells():
    return [ScriptedCell("actor", 0), ScriptedCell("actor", 1, num_actors=2), ScriptedCell("rollout", 0)]


@pytest.fixture
def client(cells):
    server = serve(*cells)
    with httpx.Client(base_url=server.base_url, timeout=5.0) as http:
        yield http
    server.stop()


def test_health(client):
    response = client.get("/api/v1/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_list_is_golden_and_in_registration_order(client, cells):
    cells[1].health = TriState.UNKNOWN
    cells[2].state = "Pending"
    response = client.get("/api/v1/cells")
    assert response.status_code == 200
    assert response.json() == {
        "apiVersion": "miles.io/v1",
        "kind": "CellList",
        "items": [
            golden_cell("actor-0", "actor", 0, False, "Running", ALIVE_HEALTHY),
            golden_cell("actor-1", "actor", 1, False, "Running",
                        [condition("Allocated", "True"), condition("Healthy", "Unknown", "HealthCheckUnknown"),
                         condition("Initialized", "True")]),
            golden_cell("rollout-0", "rollout", 0, False, "Pending", [condition("Allocated", "False")]),
        ],
    }


def test_get_cell_is_golden(client):
    response = client.get("/api/v1/cells/actor-0")
    assert response.status_code == 200
    assert response.json() == golden_cell("actor-0", "actor", 0, False, "Running", ALIVE_HEALTHY)


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/api/v1/cells/actor-9", None),
    ("PATCH", "/api/v1/cells/actor-9", {"spec": {"suspend": True}}),
    ("POST", "/api/v1/cells/actor-9/inject-fault", {"mode": "sigkill"}),
])
def test_unknown_cell_is_404_status(client, method, path, body):
    response = client.request(method, path, json=body)
    assert response.status_code == 404
    assert response.json() == k8s_status(404, "NotFound", "Cell 'actor-9' not found")


def test_patch_suspend_returns_state_after_change_and_is_idempotent(client, cells):
    suspended = golden_cell("actor-1", "actor", 1, True, "Suspended", [condition("Allocated", "False")])
    for _ in range(2):
        response = client.patch("/api/v1/cells/actor-1", json={"spec": {"suspend": True}})
        assert response.status_code == 200
        assert response.json() == suspended
    assert cells[1].state == "Stopped"
    assert client.get("/api/v1/cells/actor-1").json() == suspended


def test_patch_resume_moves_stopped_to_pending(client, cells):
    cells[0].state = "Stopped"
    response = client.patch("/api/v1/cells/actor-0", json={"spec": {"suspend": False}})
    assert response.status_code == 200
    assert response.json() == golden_cell("actor-0", "actor", 0, False, "Pending", [condition("Allocated", "False")])
    assert cells[0].calls == ["resume"]


@pytest.mark.parametrize("body", [{}, {"spec": None}, {"spec": {}}, {"spec": {"suspend": None}}])
def test_patch_without_suspend_is_a_noop(client, cells, body):
    response = client.patch("/api/v1/cells/actor-0", json=body)
    assert response.status_code == 200
    assert response.json() == golden_cell("actor-0", "actor", 0, False, "Running", ALIVE_HEALTHY)
    assert cells[0].calls == []


@pytest.mark.parametrize("suspend", [True, False])
def test_patch_failure_is_500_status(client, cells, suspend):
    cells[0].fail_patch = True
    response = client.patch("/api/v1/cells/actor-0", json={"spec": {"suspend": suspend}})
    assert response.status_code == 500
    assert response.json() == k8s_status(500, "InternalError", "Failed to patch cell 'actor-0'")


@pytest.mark.parametrize("body, error_type", [
    ({"spec": {"suspend": True}, "metadata": {}}, "extra_forbidden"),
    ({"spec": {"suspend": True, "replicas": 2}}, "extra_forbidden"),
    ({"spec": {"suspend": "yes"}}, "bool_type"),
    ({"spec": {"suspend": 1}}, "bool_type"),
    ({"spec": "suspend"}, "model_attributes_type"),
])
def test_patch_malformed_body_is_422_and_touches_nothing(client, cells, body, error_type):
    response = client.patch("/api/v1/cells/actor-0", json=body)
    assert response.status_code == 422
    assert [e["type"] for e in response.json()["detail"]] == [error_type]
    assert cells[0].calls == []


def test_patch_invalid_json_is_422(client, cells):
    response = client.patch("/api/v1/cells/actor-0", content=b"{suspend", headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["type"] == "json_invalid"
    assert cells[0].calls == []


@pytest.mark.parametrize("mode", [m.value for m in FailureMode])
def test_inject_fault_accepts_every_mode_with_default_sub_index(client, cells, mode):
    response = client.post("/api/v1/cells/actor-0/inject-fault", json={"mode": mode})
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert cells[0].injected == [(FailureMode(mode), 0)]


def test_inject_fault_passes_sub_index(client, cells):
    assert client.post("/api/v1/cells/actor-1/inject-fault", json={"mode": "exit", "sub_index": 1}).status_code == 200
    assert cells[1].injected == [(FailureMode.EXIT, 1)]


def test_inject_fault_unsupported_is_400_with_error_text(client):
    response = client.post("/api/v1/cells/rollout-0/inject-fault", json={"mode": "sigkill"})
    assert response.status_code == 400
    assert response.json() == k8s_status(400, "BadRequest", "rollout cells do not support fault injection")


@pytest.mark.parametrize("state, sub_index", [("Stopped", 0), ("Pending", 0), ("AllocatedAlive", -1),
                                              ("AllocatedAlive", 2)])
def test_inject_fault_into_dead_cell_or_bad_sub_index_is_500(client, cells, state, sub_index):
    cells[1].state = state
    response = client.post("/api/v1/cells/actor-1/inject-fault", json={"mode": "sigkill", "sub_index": sub_index})
    assert response.status_code == 500
    assert response.json() == k8s_status(500, "InternalError", "Failed to inject fault into cell 'actor-1'")
    assert cells[1].injected == []


@pytest.mark.parametrize("body, error_type", [
    ({"mode": "oom"}, "enum"),
    ({}, "missing"),
    ({"mode": "sigkill", "sub_index": "0"}, "int_type"),
    ({"mode": "sigkill", "cell": "actor-0"}, "extra_forbidden"),
])
def test_inject_fault_malformed_body_is_422(client, cells, body, error_type):
    response = client.post("/api/v1/cells/actor-0/inject-fault", json=body)
    assert response.status_code == 422
    assert [e["type"] for e in response.json()["detail"]] == [error_type]
    assert cells[0].injected == []


def test_failing_status_read_is_500_status_and_the_connection_survives(client, cells):
    cells[0].state = "Bogus"  # compute_cell_status raises for it
    response = client.get("/api/v1/cells")
    assert response.status_code == 500
    assert response.json() == k8s_status(500, "InternalError", "Failed to list cells")
    response = client.get("/api/v1/cells/actor-0")
    assert response.status_code == 500
    assert response.json() == k8s_status(500, "InternalError", "Failed to read cell 'actor-0'")
    cells[0].state = "AllocatedAlive"
    assert client.get("/api/v1/cells").status_code == 200


def test_busy_port_is_a_clear_input_error():
    first = serve(ScriptedCell("actor", 0))
    try:
        with pytest.raises(InputError, match=rf"^port {first.port} on 127\.0\.0\.1 is busy$"):
            ControlServer(CellRegistry(), port=first.port).start()
    finally:
        first.stop()


def test_stop_closes_the_port():
    server = serve(ScriptedCell("actor", 0))
    url = server.base_url
    assert httpx.get(f"{url}/api/v1/health").status_code == 200
    server.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/api/v1/health", timeout=1.0)


def test_registering_a_duplicate_name_raises():
    registry = CellRegistry()
    registry.register(ScriptedCell("actor", 0))
    registry.register(ScriptedCell("rollout", 0))
    with pytest.raises(ValueError, match="actor-0"):
        registry.register(ScriptedCell("actor", 0))


# ---- compute_cell_status ----------------------------------------------------------

@pytest.mark.parametrize("state, health, phase, conditions, suspended", [
    ("AllocatedAlive", TriState.TRUE, "Running",
     [("Allocated", "True", None), ("Healthy", "True", None), ("Initialized", "True", None)], False),
    ("AllocatedAlive", TriState.FALSE, "Running",
     [("Allocated", "True", None), ("Healthy", "False", "HealthCheckFailed"), ("Initialized", "True", None)], False),
    ("AllocatedAlive", TriState.UNKNOWN, "Running",
     [("Allocated", "True", None), ("Healthy", "Unknown", "HealthCheckUnknown"), ("Initialized", "True", None)],
     False),
    ("AllocatedUninitialized", TriState.FALSE, "Running",
     [("Allocated", "True", None), ("Healthy", "True", None), ("Initialized", "False", "AwaitingHeal")], False),
    ("AllocatedErrored", TriState.TRUE, "Running",
     [("Allocated", "True", None), ("Healthy", "False", "ExecutionErrored")], False),
    ("Pending", TriState.TRUE, "Pending", [("Allocated", "False", None)], False),
    ("Stopped", TriState.TRUE, "Suspended", [("Allocated", "False", None)], True),
])
def test_compute_cell_status_table(state, health, phase, conditions, suspended):
    snapshot = compute_cell_status(state, health)
    assert snapshot.phase == phase
    assert [(c.type, c.status.value, c.reason) for c in snapshot.conditions] == conditions
    assert all(c.message is None and c.lastTransitionTime is None for c in snapshot.conditions)
    assert snapshot.suspended is suspended


def test_compute_cell_status_covers_every_trainer_cell_state():
    from ftexp.trainer.cell import CellState

    for state in CellState:
        compute_cell_status(state.value, TriState.TRUE)
    with pytest.raises(ValueError, match="Exploded"):
        compute_cell_status("Exploded", TriState.TRUE)
