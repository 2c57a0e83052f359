"""The stand-in replica's /v1/completions: a body read with vLLM's fields, defaults and errors into the engine's
request, and the OpenAI completion object (with vLLM's `token_ids`) written back."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeline.evaluation import speculative
from pipeline.evaluation.rejection_sampler import RequestSampling
from pipeline.sampling import SamplingError, SamplingParams
from pipeline.serving.standin.engine import Completion


@dataclass(frozen=True)
class ServedModel:
    """What a request is checked against: the served name, the policy's vocabulary and context, its device."""

    name: str
    vocab_size: int
    max_model_len: int
    device: torch.device


def error_body(status: int, message: str) -> dict:
    """vLLM's error response (`ErrorResponse`): the message, the error's type and the HTTP status as its code."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class ContextLengthError(ValueError):
    """A request longer than the policy's context (vLLM answers it 400 with the same message)."""


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Prompt plus max_tokens within the policy's context, with vLLM's messages; a request over it is refused
    before admission, so no prompt is too large to prefill beside the others."""
    if prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.")
    if prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens}).")


@dataclass(frozen=True)
class Wants:
    """What a completion request asked to see beyond the text."""

    logprobs: bool
    token_ids: bool


def completion_request(body: dict, served: ServedModel) -> tuple[speculative.Request, Wants]:
    """A /v1/completions body (vLLM's fields and defaults) -> the engine's request; ValueError names the field."""
    prompt = body["prompt"]
    vocab = served.vocab_size
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < vocab for t in prompt)):
        raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab}) (the stand-in has no "
                         "tokenizer)")
    if body.get("model") != served.name:
        raise ValueError(f"model {body.get('model')!r} is not served here ({served.name!r})")
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("max_tokens must be a positive integer")
    check_context(len(prompt), max_tokens, served.max_model_len)
    if body.get("n", 1) != 1:
        raise ValueError("the stand-in serves n = 1 only")
    sampling = {name: body[name] for name in ("temperature", "top_p", "top_k") if body.get(name) is not None}
    try:
        params = SamplingParams.from_json(sampling, "the completion request")
    except SamplingError as exc:
        raise ValueError(str(exc)) from None
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64):
        raise ValueError("seed must be an integer that fits 64 bits (a torch generator's seed)")
    stop = body.get("stop_token_ids") or []
    if not (isinstance(stop, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop)):
        raise ValueError("stop_token_ids must be a list of token ids")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= 1):
        raise ValueError("logprobs must be 0 or 1: the stand-in returns the sampled token's logprob alone")
    device = served.device
    if seed is None:  # vLLM's unseeded request: a random stream of its own
        seed = torch.Generator().seed()
    request = speculative.Request(torch.tensor(prompt, dtype=torch.int64), max_tokens,
                                  RequestSampling.seeded(params, seed, device), frozenset(stop))
    return request, Wants(logprobs is not None, bool(body.get("return_token_ids")))


def completion_response(model_name: str, request: speculative.Request, wants: Wants, done: Completion) -> dict:
    """The OpenAI completion object, with vLLM's `token_ids`/`prompt_token_ids` when asked and the stand-in's own
    `standin` object."""
    choice: dict = {"index": 0, "text": " ".join(map(str, done.tokens)), "logprobs": None,
                    "finish_reason": done.finish_reason, "stop_reason": None}
    if wants.logprobs:
        names = [f"token_id:{t}" for t in done.tokens]  # vLLM's names for tokens without text
        choice["logprobs"] = {"tokens": names, "token_logprobs": done.logprobs,
                              "top_logprobs": [{n: lp} for n, lp in zip(names, done.logprobs, strict=True)],
                              "text_offset": [len(" ".join(map(str, done.tokens[:i]))) + (i > 0)
                                              for i in range(len(done.tokens))]}
    if wants.token_ids:
        choice["prompt_token_ids"] = request.prompt.tolist()
        choice["token_ids"] = done.tokens
    return {
        "id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
        "model": model_name, "choices": [choice],
        "usage": {"prompt_tokens": request.prompt.shape[0], "completion_tokens": len(done.tokens),
                  "total_tokens": request.prompt.shape[0] + len(done.tokens)},
        "standin": {"weight_version": done.weight_version, "policy_version": done.policy_version,
                    "straddles_policy_update": done.straddles_policy_update},
    }
