import pytest
import torch

from ftexp.config import ModelConfig, RolloutConfig
from ftexp.engines.torch.model import build_model
from ftexp.errors import InputError
from ftexp.rollout.recorded import deterministic_random_reward, generate_rollout, load_rollout, save_rollout
from ftexp.rundir import rollout_path


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig())


@pytest.fixture(scope="module")
def rollout(model):
    return generate_rollout(model, 0, RolloutConfig())


def test_reward_is_pinned_binary_and_varies():
    # Pinned once: sha256("[1, 2, 3][3]") starts with 0x4f (odd).
    assert deterministic_random_reward([1, 2, 3], [3]) == 1.0
    assert deterministic_random_reward([1, 2, 3], [4]) == 0.0
    assert deterministic_random_reward([5, 6, 7, 8], [7, 8]) == 1.0
    rewards = {deterministic_random_reward([i, i + 1], [i + 1]) for i in range(20)}
    assert rewards == {0.0, 1.0}


def test_rollout_shape(rollout):
    cfg = RolloutConfig()
    samples = rollout["samples"]
    assert rollout["rollout_id"] == 0
    assert rollout["metadata"]["num_samples"] == len(samples) == 256
    assert rollout["metadata"]["n_samples_per_prompt"] == 8
    for i, sample in enumerate(samples):
        assert sample["index"] == i and sample["group_index"] == i // 8
        assert len(sample["tokens"]) == cfg.prompt_len + cfg.response_len
        assert sample["response_length"] == cfg.response_len
        assert sample["loss_mask"] == [1] * cfg.response_len
        assert len(sample["rollout_log_probs"]) == cfg.response_len
        assert all(lp < 0 for lp in sample["rollout_log_probs"])
        assert sample["reward"] == deterministic_random_reward(sample["tokens"],
                                                               sample["tokens"][cfg.prompt_len:])
    # The 8 samples of a group share a prompt; groups have different prompts.
    prompts = [tuple(s["tokens"][:cfg.prompt_len]) for s in samples]
    assert all(len(set(prompts[g * 8:(g + 1) * 8])) == 1 for g in range(32))
    assert len(set(prompts)) == 32
    assert {s["reward"] for s in samples} == {0.0, 1.0}


def test_rollout_is_deterministic_and_depends_on_rollout_id(model, rollout, tmp_path):
    save_rollout(rollout, tmp_path / "a.pt")
    save_rollout(generate_rollout(model, 0, RolloutConfig()), tmp_path / "b.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    other = generate_rollout(model, 1, RolloutConfig())
    assert other["samples"][0]["tokens"] != rollout["samples"][0]["tokens"]


def test_save_load_round_trip(rollout, tmp_path):
    path = rollout_path(tmp_path / "data", 0)
    assert path == tmp_path / "data" / "0.pt"
    save_rollout(rollout, path)
    assert load_rollout(path, expected_rollout_id=0) == rollout
    assert [p.name for p in path.parent.iterdir()] == ["0.pt"]  # no temp file left behind


def test_load_missing_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_rollout(tmp_path / "nope.pt")


def test_load_corrupt_file(tmp_path):
    path = tmp_path / "0.pt"
    path.write_bytes(b"\x00garbage\xff" * 10)
    with pytest.raises(InputError, match="corrupt") as info:
        load_rollout(path)
    assert "\n" not in str(info.value)


def _corrupted(rollout, change):
    batch = {**rollout, "metadata": dict(rollout["metadata"]),
             "samples": [dict(s) for s in rollout["samples"]]}
    change(batch)
    return batch


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop("samples"), "missing keys"),
    (lambda b: b.update(samples=[]), "non-empty"),
    (lambda b: b["samples"][3].update(loss_mask=[1, 1]), "sample 3"),
    (lambda b: b["samples"][5].update(tokens="abc"), "tokens"),
    (lambda b: b["samples"][7].update(rollout_id=9), "rollout_id"),
    (lambda b: b["samples"].pop(), "whole groups"),
    (lambda b: b["metadata"].pop("n_samples_per_prompt"), "n_samples_per_prompt"),
])
def test_load_malformed_batch(rollout, tmp_path, change, message):
    path = tmp_path / "0.pt"
    torch.save(_corrupted(rollout, change), path)
    with pytest.raises(InputError, match=message):
        load_rollout(path)


def test_load_checks_expected_rollout_id(rollout, tmp_path):
    path = tmp_path / "3.pt"
    save_rollout(rollout, path)
    with pytest.raises(InputError, match="expected 3"):
        load_rollout(path, expected_rollout_id=3)


def test_load_rejects_non_dict(tmp_path):
    path = tmp_path / "0.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(InputError, match="expected a dict"):
        load_rollout(path)


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (print, ("unpickling ran code",))


@pytest.mark.parametrize("payload", [torch.zeros(2), _RunsCodeWhenUnpickled()], ids=["tensor", "callable"])
def test_load_refuses_anything_but_plain_data(rollout, tmp_path, payload, capsys):
    path = tmp_path / "0.pt"
    torch.save({**rollout, "extra": payload}, path)
    with pytest.raises(InputError, match="plain data only"):
        load_rollout(path)
    assert "unpickling ran code" not in capsys.readouterr().out
