"""A client of sglang's HTTP protocol: one method per endpoint of a rollout engine (or of the router).

It speaks to our CPU engine (``server``) and to real sglang servers alike; the router answers the
``/generate`` part. Every failure — an engine that cannot be reached, an error status, a body that
says ``success: false`` — raises `EngineError` naming the method, the URL and the engine's message.

Also here, because they are the wire format: `SamplingParams` (sglang's ``sampling_params`` object,
validated the same way on both ends) and the CPU form of ``/update_weights_from_tensor``'s payload
(`encode_named_tensors` / `decode_named_tensors`).
"""

from __future__ import annotations

import base64
import io
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import httpx
import torch

from ftexp.http_client import short_keepalive_client


class EngineError(RuntimeError):
    """A request to a rollout engine (or router) failed; the message names the URL and the cause."""


@dataclass(frozen=True)
class SamplingParams:
    """sglang's sampling parameters (the subset the CPU engine implements; its defaults).

    ``temperature == 0`` is greedy. ``sampling_seed`` makes a sample reproducible: the same
    (weights, prompt, parameters, seed) give the same tokens on any engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    sampling_seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    # Keys sglang accepts that only shape detokenization; a character tokenizer has nothing to shape.
    NO_EFFECT = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")

    @classmethod
    def from_json(cls, body: dict[str, Any] | None) -> SamplingParams:
        """Parse a request's ``sampling_params``; ``seed`` is accepted for ``sampling_seed``."""
        body = dict(body or {})
        if "seed" in body:
            seed = body.pop("seed")
            if body.get("sampling_seed") not in (None, seed):
                raise ValueError("sampling_params: seed and sampling_seed disagree")
            body["sampling_seed"] = seed
        unknown = sorted(set(body) - set(cls.__dataclass_fields__) - cls.NO_EFFECT)
        if unknown:
            raise ValueError(f"sampling_params: unsupported key(s) {unknown}")
        kwargs = {k: v for k, v in body.items() if k in cls.__dataclass_fields__ and v is not None}
        for key in ("stop_token_ids", "stop"):
            if key in kwargs:
                value = kwargs[key]
                kwargs[key] = (value,) if isinstance(value, (str, int)) else tuple(value)
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"sampling_params: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}
        return {k: v for k, v in out.items() if v not in (None, [])}


@dataclass(frozen=True)
class Generation:
    """One sequence of a ``/generate`` answer."""

    output_ids: list[int]
    text: str
    finish_reason: dict[str, Any]
    prompt_tokens: int
    # Log-probability of each sampled token under the raw (temperature 1) distribution; None unless asked.
    output_token_logprobs: list[float] | None
    weight_version: str | None
    meta_info: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Generation:
        meta = body["meta_info"]
        logprobs = meta.get("output_token_logprobs")
        return cls(output_ids=list(body["output_ids"]), text=body.get("text", ""), finish_reason=meta["finish_reason"],
                   prompt_tokens=meta["prompt_tokens"],
                   output_token_logprobs=None if logprobs is None else [float(lp) for lp, _, _ in logprobs],
                   weight_version=meta.get("weight_version"), meta_info=meta)


def encode_named_tensors(named_tensors: dict[str, torch.Tensor]) -> str:
    """The CPU engine's ``serialized_named_tensors`` entry: base64 of ``torch.save`` of {name: tensor}."""
    buffer = io.BytesIO()
    torch.save({name: t.detach().cpu().contiguous() for name, t in named_tensors.items()}, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    """Inverse of `encode_named_tensors`; loads tensors only (``weights_only``), never arbitrary objects."""
    named = torch.load(io.BytesIO(base64.b64decode(payload, validate=True)), weights_only=True)
    if not isinstance(named, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in named.items()):
        raise ValueError("serialized_named_tensors: expected a {name: tensor} dict")
    return named


def dtype_name(dtype: torch.dtype) -> str:
    """How sglang's weight-update requests spell a dtype: ``float32``, ``bfloat16``, ..."""
    return str(dtype).removeprefix("torch.")


def merge_rank_checksums(body: dict[str, Any]) -> dict[str, str]:
    """One engine's ``/weights_checker`` checksum answer as {tensor: hash}.

    An engine of several ranks (sglang with TP > 1) answers per rank: the ranks are ordered by their
    global rank and their names prefixed ``rank<r>/``; a one-rank engine keeps the plain names.
    """
    ranks = body.get("ranks") or []
    if not body.get("success") or not ranks:
        raise ValueError(f"weights_checker answered no checksums: {body.get('message', body)}")
    if len(ranks) == 1:
        return dict(ranks[0]["checksums"])
    merged = {}
    for entry in sorted(ranks, key=lambda r: r["parallelism_info"]["rank"]):
        rank = entry["parallelism_info"]["rank"]
        merged.update({f"rank{rank}/{name}": value for name, value in entry["checksums"].items()})
    return merged


class EngineClient:
    """The HTTP API of one engine at `base_url` (``http://127.0.0.1:PORT``)."""

    def __init__(self, base_url: str, timeout_s: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = short_keepalive_client(base_url=self.base_url, timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transport ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout_s: float | None = None) -> httpx.Response:
        where = f"{method} {self.base_url}{path}"
        try:
            response = self._http.request(method, path, json=body,
                                          timeout=self.timeout_s if timeout_s is None else timeout_s)
        except httpx.HTTPError as exc:
            raise EngineError(f"{where}: cannot reach the engine ({type(exc).__name__}: {exc})") from None
        if response.status_code >= 400:
            raise EngineError(f"{where}: HTTP {response.status_code}: {_error_message(response)}")
        return response

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None,
              timeout_s: float | None = None) -> Any:
        response = self._request(method, path, body, timeout_s)
        try:
            data = response.json()
        except ValueError:
            raise EngineError(f"{method} {self.base_url}{path}: answered non-JSON {response.text[:200]!r}") from None
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{method} {self.base_url}{path}: {data.get('message', data)}")
        return data

    # ---- health and info ------------------------------------------------------------------------
    def health(self) -> None:
        """Raises unless the server answers ``/health`` with 200."""
        self._request("GET", "/health", timeout_s=5.0)

    def health_generate(self, timeout_s: float = 30.0) -> None:
        """Raises unless the engine can generate a token (``/health_generate``)."""
        self._request("GET", "/health_generate", timeout_s=timeout_s)

    def is_healthy(self) -> bool:
        try:
            self.health()
        except EngineError:
            return False
        return True

    def model_info(self) -> dict[str, Any]:
        return self._json("GET", "/model_info")

    def server_info(self) -> dict[str, Any]:
        return self._json("GET", "/server_info")

    def get_weight_version(self) -> str:
        return self._json("GET", "/get_weight_version")["weight_version"]

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[int], sampling: SamplingParams, return_logprob: bool = True,
                 timeout_s: float = 600.0) -> Generation:
        body = {"input_ids": list(input_ids), "sampling_params": sampling.to_json(), "return_logprob": return_logprob}
        return Generation.from_json(self._json("POST", "/generate", body, timeout_s))

    def generate_batch(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
                       return_logprob: bool = True, timeout_s: float = 600.0) -> list[Generation]:
        """Several prompts in one request; `sampling` is shared or one per prompt."""
        params = (sampling.to_json() if isinstance(sampling, SamplingParams) else [s.to_json() for s in sampling])
        body = {"input_ids": [list(p) for p in prompts], "sampling_params": params, "return_logprob": return_logprob}
        return [Generation.from_json(item) for item in self._json("POST", "/generate", body, timeout_s)]

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def pause_generation(self, mode: str = "abort") -> None:
        self._json("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._json("POST", "/continue_generation", {})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._request("POST", "/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._request("POST", "/resume_memory_occupation", {"tags": tags})

    # ---- weights --------------------------------------------------------------------------------
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo", timeout_s: float = 120.0) -> dict[str, Any]:
        """Join the sender's weight-update group; returns once the whole group has formed."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return self._json("POST", "/init_weights_update_group", body, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, weight_version: str | None = None, flush_cache: bool = True,
                                        timeout_s: float = 300.0) -> dict[str, Any]:
        """Receive `names` by broadcast from rank 0 of the group; returns once they are loaded."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, "weight_version": weight_version}
        return self._json("POST", "/update_weights_from_distributed", body, timeout_s)

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return self._json("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_tensor(self, named_tensors: dict[str, torch.Tensor], weight_version: str | None = None,
                                   flush_cache: bool = True, timeout_s: float = 300.0) -> dict[str, Any]:
        body = {"serialized_named_tensors": [encode_named_tensors(named_tensors)], "load_format": None,
                "flush_cache": flush_cache, "weight_version": weight_version}
        return self._json("POST", "/update_weights_from_tensor", body, timeout_s)

    def weights_checker(self, action: str) -> dict[str, Any]:
        """``checksum`` | ``snapshot`` | ``compare`` | ``reset_tensors``: the engine's whole answer."""
        return self._json("POST", "/weights_checker", {"action": action}, timeout_s=120.0)

    def checksums(self) -> dict[str, str]:
        """{HF checkpoint name: hash} of the weights the engine serves with now."""
        body = self.weights_checker("checksum")
        try:
            return merge_rank_checksums(body)
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"POST {self.base_url}/weights_checker: {exc}") from None


def _error_message(response: httpx.Response) -> str:
    """The one line an sglang-style error body carries (``message``, ``error.message`` or ``detail``)."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        for value in (body.get("message"), error.get("message") if isinstance(error, dict) else error,
                      body.get("detail")):
            if value:
                return str(value)
    return str(body)[:300]
