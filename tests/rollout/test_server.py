"""The CPU sglang-protocol server, in-process: generation, weights, checksums, pause/memory, bad requests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from rollout.tiny_model import PROMPT, random_weights, write_tiny_qwen3_moe

from ftexp.audit.checksums import tensor_hash
from ftexp.rollout.client import EngineClient, EngineError, SamplingParams
from ftexp.rollout.engine_process import EngineServer
from ftexp.rollout.server import CpuEngine, sample_token
from ftexp.rollout.server_config import ServerConfig

SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16, sampling_seed=7)


def test_same_seed_same_tokens_on_two_engines_whatever_runs_beside(start_engine):
    a, b = EngineClient(start_engine()), EngineClient(start_engine())
    first = a.generate(PROMPT, SAMPLING)
    # On the other engine, with other sequences decoding at the same time.
    busy = [threading.Thread(target=b.generate, args=(PROMPT, SamplingParams(max_new_tokens=16, sampling_seed=s)))
            for s in (1, 2)]
    for t in busy:
        t.start()
    second = b.generate(PROMPT, SAMPLING)
    for t in busy:
        t.join()
    assert first.output_ids == second.output_ids and len(first.output_ids) == 16
    assert first.output_token_logprobs == second.output_token_logprobs
    assert first.finish_reason == {"type": "length", "length": 16}
    other = a.generate(PROMPT, SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16, sampling_seed=8))
    assert other.output_ids != first.output_ids


def test_logprobs_are_the_raw_distribution_of_the_sampled_tokens(start_engine, model_dir):
    out = EngineClient(start_engine()).generate(PROMPT, SamplingParams(temperature=0.5, max_new_tokens=12, sampling_seed=3))
    reference = CpuEngine(ServerConfig(str(model_dir)))  # same config and init seed: the same weights
    with torch.no_grad():
        logits = reference.model(input_ids=torch.tensor([PROMPT + out.output_ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(PROMPT) - 1:-1].gather(1, torch.tensor(out.output_ids)[:, None])
    assert torch.allclose(torch.tensor(out.output_token_logprobs), expected[:, 0], atol=1e-5)
    # Not the tempered distribution: at temperature 0.5 the log-probs would differ.
    tempered = torch.log_softmax(logits / 0.5, -1)[len(PROMPT) - 1:-1].gather(1, torch.tensor(out.output_ids)[:, None])
    assert not torch.allclose(torch.tensor(out.output_token_logprobs), tempered[:, 0], atol=1e-3)


def test_sampling_filters():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    greedy = SamplingParams(temperature=0.0)
    assert sample_token(logits, greedy, torch.Generator().manual_seed(0)) == 1
    top2 = {sample_token(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(s)) for s in range(200)}
    assert top2 == {1, 2}
    nucleus = {sample_token(logits, SamplingParams(top_p=0.3), torch.Generator().manual_seed(s)) for s in range(50)}
    assert nucleus == {1}
    free = {sample_token(logits, SamplingParams(), torch.Generator().manual_seed(s)) for s in range(400)}
    assert free == {0, 1, 2, 3}


def test_generate_shapes_batch_text_and_stop(start_engine):
    url = start_engine()
    body = {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "return_logprob": True}
    batch = httpx.post(f"{url}/generate", json=body).json()
    assert isinstance(batch, list) and len(batch) == 2
    meta = batch[0]["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 4 and meta["weight_version"] == "default"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == batch[0]["output_ids"]
    single = httpx.post(f"{url}/generate", json={"text": "12+7=", "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    assert single.json()["output_ids"] == batch[0]["output_ids"]
    assert single.json()["text"] == "".join(map(chr, batch[0]["output_ids"]))
    assert "output_token_logprobs" not in single.json()["meta_info"]
    stop_at = batch[0]["output_ids"][1]
    stopped = EngineClient(url).generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=4, stop_token_ids=(stop_at,)))
    assert stopped.finish_reason == {"type": "stop", "matched": stop_at}
    assert stopped.output_ids == batch[0]["output_ids"][:batch[0]["output_ids"].index(stop_at) + 1]


def test_weights_from_tensor_change_checksums_and_generation(start_engine, weight_shapes):
    a = EngineClient(start_engine())
    before_sum, before = a.checksums(), a.generate(PROMPT, SAMPLING)
    weights = random_weights(weight_shapes, seed=1)
    a.update_weights_from_tensor(weights, weight_version="v1")
    assert a.checksums() == {n: tensor_hash(t) for n, t in weights.items()} != before_sum
    after = a.generate(PROMPT, SAMPLING)
    assert after.output_ids != before.output_ids and after.weight_version == "v1" == a.get_weight_version()
    fresh = EngineClient(start_engine(init_seed=5))  # other initial weights, then the same update
    assert fresh.checksums() != a.checksums()
    fresh.update_weights_from_tensor(weights)
    assert fresh.generate(PROMPT, SAMPLING).output_ids == after.output_ids


def test_weights_checker_snapshot_compare_reset(start_engine):
    a = EngineClient(start_engine())
    with pytest.raises(EngineError, match="snapshot first"):
        a.weights_checker("compare")
    body = a.weights_checker("checksum")
    assert body["success"] and body["ranks"][0]["parallelism_info"]["rank"] == 0
    assert len(body["ranks"][0]["checksums"]) == 2 + 2 * 11 + 1  # embed, lm_head, 11 per layer, final norm
    a.weights_checker("snapshot")
    a.weights_checker("compare")
    a.weights_checker("reset_tensors")
    with pytest.raises(EngineError, match="differ from the snapshot: .*embed_tokens"):
        a.weights_checker("compare")
    assert a.checksums() != {n: h for n, h in body["ranks"][0]["checksums"].items()}


def test_bad_requests_get_a_clear_400_and_change_nothing(start_engine, weight_shapes):
    url = start_engine()
    a = EngineClient(url)
    before = a.checksums()
    cases = [
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                        "world_size": 2, "group_name": "g", "backend": "nccl"},
         "backend 'nccl' is not available on a CPU engine"),
        ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                              "group_name": "nope"}, "no weight-update group named 'nope'"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"temprature": 1}}, "unsupported key(s) ['temprature']"),
        ("/generate", {"input_ids": [500], "sampling_params": {}}, "outside the vocabulary"),
        ("/generate", {"input_ids": PROMPT, "stream": True}, "streaming is not supported"),
        ("/generate", {"input_ids": PROMPT, "text": "x"}, "exactly one of text and input_ids"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ("/weights_checker", {"action": "fix"}, "unknown weights_checker action 'fix'"),
        ("/update_weights_from_distributed", {"names": ["a"]}, "invalid request body: dtypes: Field required"),
    ]
    for path, body, message in cases:
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == 400, (path, response.text)
        assert message in response.text, (path, response.text)
    good = random_weights(weight_shapes, seed=2)
    with pytest.raises(EngineError, match=r"/update_weights_from_tensor: HTTP 400: unknown weight name 'model.bogus'"):
        a.update_weights_from_tensor({**good, "model.bogus": torch.zeros(1)})
    with pytest.raises(EngineError, match=r"weight lm_head.weight: shape \(64, 128\), the model's is \(128, 64\)"):
        a.update_weights_from_tensor({**good, "lm_head.weight": good["lm_head.weight"].T.contiguous()})
    response = httpx.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["not base64!"]})
    assert response.status_code == 400 and "cannot decode" in response.json()["message"]
    assert a.checksums() == before  # all or nothing
    assert a.generate(PROMPT, SAMPLING).finish_reason["type"] == "length"  # still serving


def test_pause_abort_continue(start_engine):
    a = EngineClient(start_engine())
    results = {}
    long = threading.Thread(target=lambda: results.update(long=a.generate(PROMPT, SamplingParams(max_new_tokens=240,
                                                                                                   sampling_seed=1))))
    long.start()
    deadline = time.monotonic() + 30
    while a.server_info()["internal_states"][0]["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    a.pause_generation("abort")
    long.join(timeout=30)
    assert results["long"].finish_reason["type"] == "abort" and len(results["long"].output_ids) < 240
    waiting = threading.Thread(target=lambda: results.update(late=a.generate(PROMPT, SAMPLING)))
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive()  # held while paused
    a.health_generate()  # paused by request is not unhealthy
    a.continue_generation()
    waiting.join(timeout=30)
    assert results["late"].finish_reason["type"] == "length"
    with pytest.raises(EngineError, match="pause mode 'later' is not one of"):
        a.pause_generation("later")


def test_release_and_resume_memory(start_engine, weight_shapes):
    a = EngineClient(start_engine())
    a.release_memory_occupation()
    with pytest.raises(EngineError, match=r"memory released \(cuda_graph, kv_cache, weights\)"):
        a.generate(PROMPT, SAMPLING)
    with pytest.raises(EngineError, match="weights memory released"):
        a.update_weights_from_tensor(random_weights(weight_shapes, seed=3))
    a.resume_memory_occupation(tags=["weights"])
    a.update_weights_from_tensor(random_weights(weight_shapes, seed=3), weight_version="v3")
    a.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    assert a.generate(PROMPT, SAMPLING).weight_version == "v3"


def test_info_endpoints(start_engine, model_dir):
    url = start_engine()
    a = EngineClient(url)
    info = a.model_info()
    assert info["model_path"] == str(model_dir.resolve()) and info["is_generation"] is True
    assert httpx.get(f"{url}/get_model_info").json() == info
    server = a.server_info()
    assert server["tp_size"] == 1 and server["dp_size"] == 1 and server["tokenizer_path"] == str(model_dir.resolve())
    assert httpx.get(f"{url}/get_server_info").json()["model_path"] == info["model_path"]
    a.health()
    a.health_generate()
    a.flush_cache()


def test_moe_engine_takes_and_checksums_per_expert_checkpoint_names(tmp_path):
    engine = EngineServer(ServerConfig(str(write_tiny_qwen3_moe(tmp_path / "moe"))))
    try:
        a = EngineClient(engine.start())
        before = a.checksums()
        assert "model.layers.1.mlp.experts.3.gate_proj.weight" in before and "model.layers.0.mlp.gate.weight" in before
        assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in before)  # fused tensors stay inside
        name, tensor = "model.layers.0.mlp.experts.2.up_proj.weight", torch.randn(32, 64)
        a.update_weights_from_tensor({name: tensor})
        after = a.checksums()
        assert {n for n in before if after[n] != before[n]} == {name} and after[name] == tensor_hash(tensor)
        generated = a.generate(PROMPT, SAMPLING, return_logprob=True)
        # The router: another one mixes (and picks) other experts, so the distribution changes. Compared by
        # the log-probs of the same tokens, as a small model's experts may move them too little to resample.
        a.update_weights_from_tensor({"model.layers.0.mlp.gate.weight": torch.randn(4, 64)})
        again = a.generate(PROMPT, SAMPLING, return_logprob=True)
        assert (again.output_ids, again.output_token_logprobs) != (generated.output_ids, generated.output_token_logprobs)
    finally:
        engine.stop()
