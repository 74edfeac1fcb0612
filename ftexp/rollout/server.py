"""Our CPU rollout engine: a transformers causal LM behind sglang's HTTP protocol (FastAPI).

It answers what a trainer and the sglang router ask of an sglang 0.5 server — generation with
seeded sampling and per-token logprobs, the weight-update group and ``update_weights_from_distributed``,
``update_weights_from_tensor``, ``weights_checker``, pause/continue, release/resume memory — with
the same request and response shapes, so the driver's code is the same against real sglang on GPUs.

Determinism: generation depends only on (weights, prompt, sampling parameters, ``sampling_seed``),
never on which engine serves it or what else is in flight. Each sequence is decoded alone (batch 1)
with its own KV cache and its own ``torch.Generator``; forward steps run one at a time; and a
sequence holds the weights' read lock from its first to its last token, so a weight update (the
write lock) waits for sequences in flight and no sequence mixes two weight versions.

Weights are addressed by their Hugging Face checkpoint names (``hf_layout`` maps them onto the
model's parameters, per-expert names onto fused expert tensors included). Checksums
(``/weights_checker``) hash each checkpoint-named tensor with ``ftexp.audit.checksums.tensor_hash``,
so a sender can compute the expected ones from its own tensors.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from ftexp.audit.checksums import digest, tensor_hash
from ftexp.engines.megatron.hf_import import checkpoint_weight_files, has_weights, read_tensors
from ftexp.errors import InputError, one_line
from ftexp.rollout import weight_group
from ftexp.rollout.client import SamplingParams, decode_named_tensors
from ftexp.rollout.hf_layout import build_model, hf_state_dict, load_hf_weights
from ftexp.rollout.processes import stay_offline
from ftexp.rollout.server_config import ServerConfig

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class BadRequest(Exception):
    """The request cannot be served as asked; the message (one line) goes back with HTTP 400."""


class ReadWriteLock:
    """Many readers (sequences being decoded) or one writer (a weight change); a waiting writer goes first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `logits` (float32, 1-D): greedy at temperature 0, else temperature, top-k, top-p."""
    if params.temperature == 0 or params.top_k == 1:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
        drop = torch.cumsum(sorted_probs, dim=0) - sorted_probs >= params.top_p
        probs = probs.clone()
        probs[order[drop]] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


class CpuEngine:
    """The model, its weights' bookkeeping and the generation loop; `build_app` puts HTTP in front."""

    def __init__(self, config: ServerConfig) -> None:
        # A rollout engine never reaches the Hugging Face hub: everything it loads is a local
        # directory. Set before transformers is first imported, which may be here: importing this
        # module stays cheap for a process that only checks or decodes what an engine sends.
        stay_offline()
        from transformers import AutoTokenizer, DynamicCache

        self._new_cache = DynamicCache
        self.config = config
        self.model_path = str(Path(config.model_path).resolve())
        tokenizer_path = config.tokenizer_path or config.model_path
        self.tokenizer_path = str(Path(tokenizer_path).resolve())
        self.weight_version = config.weight_version
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.init_seed)
            self.model = build_model(self.model_path)
        if has_weights(self.model_path):
            named = read_tensors(checkpoint_weight_files(self.model_path))
            missing = sorted(set(hf_state_dict(self.model)) - set(named))
            if missing:
                raise InputError(f"{self.model_path}: {len(missing)} weight(s) missing, e.g. {missing[0]}")
            load_hf_weights(self.model, named)
        hf_config = self.model.config
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        eos = hf_config.eos_token_id
        self.eos_token_ids = set() if eos is None else set(eos if isinstance(eos, list) else [eos])
        self.vocab_size = hf_config.vocab_size
        self.context_length = hf_config.max_position_embeddings
        self.model_type = hf_config.model_type
        self.architectures = list(hf_config.architectures or [type(self.model).__name__])

        self._weights_lock = ReadWriteLock()
        self._compute_lock = threading.Lock()
        self._update_lock = threading.Lock()  # one weight-group operation at a time
        self._pause = threading.Condition()
        self._paused_mode: str | None = None
        self._released: set[str] = set()
        self._group: weight_group.WeightGroup | None = None
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._running = 0  # sequences being decoded now
        self._running_lock = threading.Lock()

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompt: list[int], params: SamplingParams, return_logprob: bool,
                 rid: str | None = None) -> dict[str, Any]:
        """One sequence, answered as sglang answers one request of ``/generate``."""
        if not prompt:
            raise BadRequest("input_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.context_length:
            raise BadRequest(f"prompt of {len(prompt)} tokens does not fit the context length {self.context_length}")
        started = time.monotonic()
        self._wait_unpaused()
        with self._weights_lock.reading():
            if self._released:
                raise BadRequest(f"memory released ({', '.join(sorted(self._released))}): "
                                 "call /resume_memory_occupation first")
            version = self.weight_version
            with self._running_lock:
                self._running += 1
            try:
                output_ids, logprobs, finish = self._decode(prompt, params)
            finally:
                with self._running_lock:
                    self._running -= 1
        stop_trim = 1 if finish["type"] == "stop" and isinstance(finish.get("matched"), int) else 0
        text = self.tokenizer.decode(output_ids[:len(output_ids) - stop_trim])
        if finish["type"] == "stop" and isinstance(finish.get("matched"), str):
            text = text.removesuffix(finish["matched"])
        meta = {"id": rid or uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(prompt),
                "completion_tokens": len(output_ids), "cached_tokens": 0, "weight_version": version,
                "e2e_latency": time.monotonic() - started}
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, output_ids)]
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    @torch.inference_mode()
    def _decode(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], dict[str, Any]]:
        seed = params.sampling_seed if params.sampling_seed is not None else int.from_bytes(os.urandom(8), "little")
        generator = torch.Generator().manual_seed(seed)
        cache = self._new_cache(config=self.model.config)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        limit = min(params.max_new_tokens, self.context_length - len(prompt))
        step_input = torch.tensor([prompt])
        output_ids: list[int] = []
        logprobs: list[float] = []
        while len(output_ids) < limit:
            if self._paused_mode == "abort":
                return output_ids, logprobs, {"type": "abort", "message": "generation paused (abort)"}
            with self._compute_lock:
                logits = self.model(input_ids=step_input, cache=cache, use_cache=True).logits[0, -1].float()
            token = sample_token(logits, params, generator)
            output_ids.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            if token in stop_ids:
                return output_ids, logprobs, {"type": "stop", "matched": token}
            if params.stop:
                text = self.tokenizer.decode(output_ids)
                matched = next((s for s in params.stop if text.endswith(s)), None)
                if matched is not None:
                    return output_ids, logprobs, {"type": "stop", "matched": matched}
            step_input = torch.tensor([[token]])
        return output_ids, logprobs, {"type": "length", "length": len(output_ids)}

    def health_generate(self) -> None:
        """Generate one token unless paused or released (then the engine is idle by request, not broken)."""
        if self._paused_mode is None and not self._released:
            self.generate([0], SamplingParams(temperature=0.0, max_new_tokens=1), return_logprob=False)

    # ---- pause / memory -------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        """``abort``: sequences in flight stop at their next token; ``retract`` / ``in_place``: they
        finish. Either way new requests wait for `resume`, and a weight update can run meanwhile."""
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        with self._pause:
            self._paused_mode = mode

    def resume(self) -> None:
        with self._pause:
            self._paused_mode = None
            self._pause.notify_all()

    def _wait_unpaused(self) -> None:
        with self._pause:
            self._pause.wait_for(lambda: self._paused_mode is None)

    def release_memory(self, tags: list[str] | None) -> None:
        """CPU engines keep their memory; the release is bookkeeping that refuses generation until resumed."""
        tags = self._memory_tags(tags)
        with self._weights_lock.writing():
            self._released |= tags

    def resume_memory(self, tags: list[str] | None) -> None:
        tags = self._memory_tags(tags)
        with self._weights_lock.writing():
            self._released -= tags

    @staticmethod
    def _memory_tags(tags: list[str] | None) -> set[str]:
        unknown = sorted(set(tags or ()) - set(MEMORY_TAGS))
        if unknown:
            raise BadRequest(f"unknown memory tag(s) {unknown} (tags: {', '.join(MEMORY_TAGS)})")
        return set(tags) if tags else set(MEMORY_TAGS)

    # ---- weights --------------------------------------------------------------------------------
    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{checkpoint name: (shape, dtype)} of every weight the engine serves."""
        return {name: (tuple(t.shape), t.dtype) for name, t in hf_state_dict(self.model).items()}

    def load_weights(self, named: dict[str, torch.Tensor], weight_version: str | None) -> None:
        """Copy `named` into the model all or nothing, once no sequence is being decoded."""
        with self._weights_lock.writing():
            if "weights" in self._released:
                raise BadRequest("weights memory released: resume_memory_occupation(tags=['weights']) first")
            try:
                load_hf_weights(self.model, named)  # checks every name and shape before writing any
            except InputError as exc:
                raise BadRequest(str(exc)) from None
            if weight_version is not None:
                self.weight_version = weight_version

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str) -> None:
        if backend != "gloo":
            raise BadRequest(f"backend {backend!r} is not available on a CPU engine: use 'gloo'")
        if not 0 < rank_offset < world_size:
            raise BadRequest(f"rank_offset {rank_offset} must be in [1, world_size={world_size}): rank 0 is the sender")
        with self._update_lock:
            self._group = None  # a new group replaces the old one, whatever happens next
            timeout = self.config.weight_group_timeout_s
            try:
                store = weight_group.store_client(master_address, master_port, timeout)
                self._group = weight_group.join(store, group_name, rank_offset, world_size, timeout,
                                                device_host=weight_group.address_toward(master_address))
            except (RuntimeError, ValueError, OSError) as exc:
                raise BadRequest(f"cannot form weight-update group {group_name!r} via "
                                 f"{master_address}:{master_port}: {one_line(exc)}") from None

    def destroy_weight_group(self, group_name: str) -> None:
        with self._update_lock:
            if self._group is None or self._group.name != group_name:
                raise BadRequest(f"no weight-update group named {group_name!r}")
            self._group = None

    def update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                group_name: str, weight_version: str | None) -> None:
        """Receive each tensor by broadcast from rank 0, in `names` order, then load them all.

        A request whose names or shapes do not fit the model still receives every tensor (so the
        sender's broadcasts complete and it reads this engine's refusal) and then loads nothing.
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        torch_dtypes = []
        for name, dtype in zip(names, dtypes):
            value = getattr(torch, dtype, None)
            if not isinstance(value, torch.dtype):
                raise BadRequest(f"tensor {name!r}: unknown dtype {dtype!r}")
            torch_dtypes.append(value)
        with self._update_lock:
            group = self._group
            if group is None or group.name != group_name:
                current = "none" if group is None else repr(group.name)
                raise BadRequest(f"no weight-update group named {group_name!r} (current: {current})")
            received = {}
            try:
                for name, dtype, shape in zip(names, torch_dtypes, shapes):
                    tensor = torch.empty(shape, dtype=dtype)
                    group.broadcast(tensor)
                    received[name] = tensor
            except RuntimeError as exc:
                self._group = None  # a failed collective leaves the group unusable
                raise BadRequest(f"weight-update group {group_name!r} failed after {len(received)} of "
                                 f"{len(names)} tensors: {one_line(exc)}") from None
            self.load_weights(received, weight_version)

    def check_weights(self, action: str) -> list[dict[str, Any]]:
        """sglang's weights checker; returns the ``ranks`` list (one rank here)."""
        if action == "checksum":
            with self._weights_lock.reading():
                checksums = {name: tensor_hash(t) for name, t in sorted(hf_state_dict(self.model).items())}
            overall = digest("".join(f"{n}\0{h}\n" for n, h in checksums.items()).encode())
            info = {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                    "rank": 0, "size": 1}
            return [{"checksums": checksums, "per_gpu_checksum": overall, "parallelism_info": info}]
        if action == "snapshot":
            with self._weights_lock.reading():
                self._snapshot = {name: t.clone() for name, t in hf_state_dict(self.model).items()}
            return []
        if action == "compare":
            if self._snapshot is None:
                raise BadRequest("compare needs a snapshot first (action 'snapshot')")
            with self._weights_lock.reading():
                current = hf_state_dict(self.model)
                differ = sorted(n for n, t in self._snapshot.items() if not torch.equal(t, current[n]))
            if differ:
                raise BadRequest(f"check tensor equality failed: {len(differ)} tensor(s) differ from the snapshot: "
                                 + ", ".join(differ[:5]))
            return []
        if action == "reset_tensors":
            shapes = self.weight_shapes()
            self.load_weights({n: torch.rand(s, dtype=d) for n, (s, d) in shapes.items()}, None)
            return []
        raise BadRequest(f"unknown weights_checker action {action!r} (checksum, snapshot, compare, reset_tensors)")

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": self.model_type, "architectures": self.architectures}

    def server_info(self) -> dict[str, Any]:
        state = {"num_running_reqs": self._running, "paused": self._paused_mode, "released": sorted(self._released)}
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path,
                "served_model_name": self.model_path, "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
                "device": "cpu", "context_length": self.context_length, "weight_version": self.weight_version,
                "random_seed": self.config.init_seed, "internal_states": [state], "version": "ftexp-cpu"}


# ---- HTTP -------------------------------------------------------------------------------------------
class _Lenient(BaseModel):
    # The router and sglang clients send fields this engine has no use for (stream flags, lora, ...).
    model_config = ConfigDict(extra="ignore")


class GenerateRequest(_Lenient):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    rid: str | list[str] | None = None
    stream: bool = False


class PauseRequest(_Lenient):
    mode: str = "abort"


class MemoryRequest(_Lenient):
    tags: list[str] | None = None


class InitGroupRequest(_Lenient):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class GroupNameRequest(_Lenient):
    group_name: str = "weight_update_group"


class UpdateDistributedRequest(_Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None


class UpdateTensorRequest(_Lenient):
    # One entry per engine rank (one here): base64 of ``torch.save({name: tensor})`` — see
    # ``client.encode_named_tensors``. sglang's GPU form carries CUDA IPC handles instead.
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    weight_version: str | None = None


class WeightsCheckerRequest(_Lenient):
    action: str


def _per_item(value: Any, count: int, what: str, scalar_type: type | tuple[type, ...]) -> list[Any]:
    if value is None or isinstance(value, scalar_type):
        return [value] * count
    if len(value) != count:
        raise BadRequest(f"{what} has {len(value)} entries for {count} prompts")
    return list(value)


def _prompts(engine: CpuEngine, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The request's prompts as token ids, and whether it was a batch (answered with a list)."""
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("give exactly one of text and input_ids")
    if req.input_ids is not None:
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        return (req.input_ids if batch else [req.input_ids]), batch
    texts = req.text if isinstance(req.text, list) else [req.text]
    return [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts], isinstance(req.text, list)


def build_app(engine: CpuEngine) -> FastAPI:
    app = FastAPI(openapi_url=None)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        if request.url.path == "/generate":
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        return JSONResponse({"success": False, "message": str(exc)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"success": False, "message": f"invalid request body: {details}"}, status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s failed", request.url.path)
        return JSONResponse({"success": False, "message": f"internal error: {one_line(exc)}"}, status_code=500)

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    def health_generate() -> Response:
        engine.health_generate()
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    def server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.get("/get_weight_version")
    def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.api_route("/generate", methods=["POST", "PUT"])
    def generate(req: GenerateRequest) -> Any:
        if req.stream:
            raise BadRequest("streaming is not supported by the CPU engine")
        prompts, batch = _prompts(engine, req)
        n = len(prompts)
        try:
            params = [SamplingParams.from_json(p) for p in _per_item(req.sampling_params, n, "sampling_params", dict)]
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        logprob = _per_item(req.return_logprob, n, "return_logprob", bool)
        rids = _per_item(req.rid, n, "rid", str)
        outs = [engine.generate(p, s, bool(lp), rid) for p, s, lp, rid in zip(prompts, params, logprob, rids)]
        return outs if batch else outs[0]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> Response:
        # Each sequence's KV cache lives and dies with it: there is no cache shared across requests.
        return Response(content="Cache flushed.\n", status_code=200)

    @app.post("/pause_generation")
    def pause_generation(req: PauseRequest | None = None) -> dict[str, Any]:
        engine.pause((req or PauseRequest()).mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    def continue_generation() -> dict[str, Any]:
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    def release_memory_occupation(req: MemoryRequest | None = None) -> Response:
        engine.release_memory((req or MemoryRequest()).tags)
        return Response(status_code=200)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    def resume_memory_occupation(req: MemoryRequest | None = None) -> Response:
        engine.resume_memory((req or MemoryRequest()).tags)
        return Response(status_code=200)

    @app.post("/init_weights_update_group")
    def init_weights_update_group(req: InitGroupRequest) -> dict[str, Any]:
        engine.init_weight_group(req.master_address, req.master_port, req.rank_offset, req.world_size,
                                 req.group_name, req.backend)
        return {"success": True, "message": f"Joined weight-update group {req.group_name!r} as rank {req.rank_offset}."}

    @app.post("/destroy_weights_update_group")
    def destroy_weights_update_group(req: GroupNameRequest) -> dict[str, Any]:
        engine.destroy_weight_group(req.group_name)
        return {"success": True, "message": f"Destroyed weight-update group {req.group_name!r}."}

    @app.post("/update_weights_from_distributed")
    def update_weights_from_distributed(req: UpdateDistributedRequest) -> dict[str, Any]:
        engine.update_from_distributed(req.names, req.dtypes, req.shapes, req.group_name, req.weight_version)
        return {"success": True, "message": _updated(len(req.names), req.weight_version)}

    @app.post("/update_weights_from_tensor")
    def update_weights_from_tensor(req: UpdateTensorRequest) -> dict[str, Any]:
        if len(req.serialized_named_tensors) != 1:
            raise BadRequest(f"serialized_named_tensors has {len(req.serialized_named_tensors)} entries; "
                             "this engine has 1 rank")
        try:
            named = decode_named_tensors(req.serialized_named_tensors[0])
        except Exception as exc:  # base64, pickle and type errors alike: the payload is unreadable
            raise BadRequest(f"serialized_named_tensors: cannot decode ({one_line(exc)})") from None
        engine.load_weights(named, req.weight_version)
        return {"success": True, "message": _updated(len(named), req.weight_version)}

    @app.post("/weights_checker")
    def weights_checker(req: WeightsCheckerRequest) -> dict[str, Any]:
        ranks = engine.check_weights(req.action)
        return {"success": True, "message": f"{req.action} done.", "ranks": ranks}

    return app


def _updated(count: int, weight_version: str | None) -> str:
    message = f"Succeeded to update {count} model weights."
    return message + (f" Weight version updated to {weight_version}." if weight_version is not None else "")

