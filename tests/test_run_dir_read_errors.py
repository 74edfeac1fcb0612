"""Every run-dir file that cannot be read is one line naming the file and the cause (RunDirError, exit 2).

Dumps, events, metrics, checkpoints and rollout data: corrupt, truncated, missing, not permitted.
A "not permitted" file is simulated where the tests run as root (who may read anything).
"""

import json
import zipfile

import pytest
import torch

from ftexp.audit.dumps import load_dump, write_dump
from ftexp.audit.events import EventLogger, MetricEvent, ProcessIdentity, read_events
from ftexp.errors import InputError, RunDirError, file_error, one_line
from ftexp.pipeline import read_metric_series
from ftexp.rollout.recorded import load_rollout
from ftexp.rundir import TRACKER, iter_dir
from ftexp.trainer.checkpoint import check_resumable, load_rank_state

COORDS = {"pp": 0, "tp": 0, "cp": 0, "ep": 0}


def _single_line(exc: BaseException, *fragments: str) -> None:
    text = str(exc)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, text


def test_one_line_keeps_torchs_reason_not_its_advice(tmp_path):
    path = tmp_path / "x.pt"
    path.write_bytes(b"garbage\n")
    with pytest.raises(Exception) as info:
        torch.load(path, weights_only=True)
    assert len(str(info.value).splitlines()) > 1  # what torch says: several lines of advice
    _single_line(file_error(path, info.value, "dump file"), f"corrupt dump file {path}: UnpicklingError: ")


def test_file_error_names_the_cause():
    assert str(file_error("/r/a.pt", FileNotFoundError(2, "No such file or directory"))) == "missing file /r/a.pt"
    assert str(file_error("/r/a.pt", PermissionError(13, "Permission denied"), "dump file")) == \
        "cannot read dump file /r/a.pt: Permission denied"
    err = file_error("/r/a.pt", ValueError("bad\nmore"))
    assert isinstance(err, InputError) and isinstance(err, ValueError) and str(err) == "corrupt file /r/a.pt: ValueError: bad"
    assert one_line(RuntimeError("x" * 500)).endswith("…")


@pytest.mark.parametrize("damage, fragment", [
    (lambda p: p.write_bytes(b"garbage"), "corrupt dump file"),
    (lambda p: p.write_bytes(p.read_bytes()[:100]), "corrupt dump file"),   # truncated
    (lambda p: p.unlink(), "missing dump file"),
    (lambda p: torch.save([1, 2], p), "not a tensor dump"),
])
def test_dump_read_errors(tmp_path, damage, fragment):
    path = write_dump(tmp_path, "grad__w", torch.ones(3), step=0, rank=0, dump_index=0, **COORDS)
    damage(path)
    with pytest.raises(RunDirError) as info:
        load_dump(path)
    _single_line(info.value, fragment, str(path))


def test_dump_not_permitted(tmp_path, monkeypatch):
    path = write_dump(tmp_path, "grad__w", torch.ones(3), step=0, rank=0, dump_index=0, **COORDS)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(RunDirError) as info:
        load_dump(path)
    _single_line(info.value, f"cannot read dump file {path}: Permission denied")


def _events(tmp_path):
    logger = EventLogger(tmp_path, ProcessIdentity(component="main"))
    for i in range(3):
        logger.log(MetricEvent(rollout_id=i, attempt=0, metrics={"train/loss": 1.0 / (i + 1)}))
    return next(tmp_path.glob("*.jsonl"))


def test_truncated_event_line(tmp_path):
    path = _events(tmp_path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1][:30], lines[2]]) + "\n")
    with pytest.raises(RunDirError) as info:
        read_events(tmp_path)
    _single_line(info.value, f"{path}:2: not a valid event")
    assert len(read_events(tmp_path, strict=False)) == 2  # the lenient reader skips it


def test_binary_or_unreadable_event_log(tmp_path, monkeypatch):
    path = _events(tmp_path)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RunDirError) as info:
        read_events(tmp_path)
    _single_line(info.value, f"corrupt event log {path}")
    path.write_text("")
    real_read_text = type(path).read_text

    def denied(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "read_text", denied)
    with pytest.raises(RunDirError) as info:
        read_events(tmp_path)
    _single_line(info.value, f"cannot read event log {path}: Permission denied")


def test_metrics_lines(tmp_path):
    side = tmp_path / "target"
    side.mkdir()
    good = [{"step": 0, "attempt": 0, "train/loss": 1.0}, {"step": 1, "attempt": 0, "train/loss": 0.5}]
    (side / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in good) + "\n")
    assert read_metric_series(side) == {"train/loss": [(0, 1.0), (1, 0.5)]}
    (side / "metrics.jsonl").write_text(json.dumps(good[0]) + "\n" + json.dumps(good[1])[:20] + "\n")
    with pytest.raises(RunDirError) as info:
        read_metric_series(side)
    _single_line(info.value, f"{side / 'metrics.jsonl'}:2: not a valid metrics line")
    assert read_metric_series(side, strict=False) == {"train/loss": [(0, 1.0)]}
    (side / "metrics.jsonl").write_text('{"attempt": 0}\n')
    with pytest.raises(RunDirError, match="metrics.jsonl:1"):
        read_metric_series(side)


def _checkpoint(root, rollout_id=1):
    directory = iter_dir(root, rollout_id)
    directory.mkdir(parents=True)
    path = directory / "state_pp0_tp0_cp0_ep0.pt"
    torch.save({"w": torch.ones(2)}, path)
    (root / TRACKER).write_text(f"{rollout_id}\n")
    return path


def test_checkpoint_checks_before_a_resumed_phase(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(RunDirError) as info:
        check_resumable(root)
    _single_line(info.value, "missing checkpoint tracker", TRACKER)
    path = _checkpoint(root)
    assert check_resumable(root) == 1
    assert zipfile.is_zipfile(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short
    with pytest.raises(RunDirError) as info:
        check_resumable(root)
    _single_line(info.value, f"corrupt checkpoint file {path}")
    path.unlink()
    with pytest.raises(RunDirError, match="holds no state_"):
        check_resumable(root)
    (root / TRACKER).write_text("garbage")
    with pytest.raises(RunDirError, match="is not a rollout id"):
        check_resumable(root)


def test_checkpoint_load_errors(tmp_path):
    root = tmp_path / "ckpt"
    path = _checkpoint(root)
    assert torch.equal(load_rank_state(root, 1, COORDS)["w"], torch.ones(2))
    path.write_bytes(b"garbage")
    with pytest.raises(RunDirError) as info:
        load_rank_state(root, 1, COORDS)
    _single_line(info.value, f"corrupt checkpoint file {path}")
    with pytest.raises(RunDirError, match="no checkpoint"):
        load_rank_state(root, 2, COORDS)


def test_rollout_not_permitted(tmp_path, monkeypatch):
    path = tmp_path / "0.pt"
    torch.save({"x": 1}, path)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(RunDirError) as info:
        load_rollout(path)
    _single_line(info.value, f"cannot read rollout file {path}: Permission denied")
