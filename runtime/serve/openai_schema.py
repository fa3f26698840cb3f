"""OpenAI chat-completions requests in, response objects out: validation with one-line messages, no I/O.

A request is checked completely before it is queued: every error names the field (``param``) and what was
expected, so a client's mistake is a 400, never an exception deeper in.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..sampling import GenerationConfig

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
# accepted and ignored: they change nothing we do (or only billing and logging, at OpenAI)
IGNORED = {"model", "user", "frequency_penalty", "presence_penalty", "logit_bias", "store", "metadata",
           "service_tier", "parallel_tool_calls", "stream_options", "n", "logprobs", "top_logprobs",
           "response_format", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort", "modalities"}


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}], system prompt first
    config: GenerationConfig
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    asked_max_tokens: int | None  # what the client asked for (before the cap)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _content(m, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, list):  # content parts: text only
        out = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                 "are supported", f"messages[{i}].content")
            out.append(part["text"])
        return "".join(out)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts, got "
                     f"{type(c).__name__}", f"messages[{i}].content")


def _encodable(text: str) -> bool:
    """JSON's \\ud800 escapes decode to lone surrogates, which are not UTF-8 and cannot be tokenized."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _messages(raw, system_prompt: str) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty array of {role, content}", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with role and content", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r:.40}",
                             f"messages[{i}].role")
        if m.get("tool_calls") or m.get("function_call"):
            raise BadRequest(f"messages[{i}]: tool calls are not supported", f"messages[{i}]")
        text = _content(m, i)
        if "\0" in text or not _encodable(text):
            raise BadRequest(f"messages[{i}].content contains a NUL character or a lone surrogate (\\ud800-\\udfff)",
                             f"messages[{i}].content")
        out.append({"role": ROLES[role], "content": text})
    if out[0]["role"] != "system" and system_prompt:
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def parse_chat_request(body, *, max_tokens_cap: int, system_prompt: str) -> ChatRequest:
    """A validated ChatRequest from a decoded JSON body, or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("n") not in (None, 1):
        raise BadRequest("n must be 1 (one choice per request)", "n")
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise BadRequest("tools are not supported", "tools")
    if body.get("logprobs") not in (None, False):
        raise BadRequest("logprobs are not supported", "logprobs")
    messages = _messages(body.get("messages"), system_prompt)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    include_usage = bool(so and so.get("include_usage"))
    asked = None
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None:
            if not _is_int(v) or v < 1:
                raise BadRequest(f"{key} must be an integer >= 1, got {v!r:.40}", key)
            asked = v
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 0.0  # greedy unless asked (OpenAI's default is 1): a small model answers best greedily
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be a number from 0 to 2, got {temperature!r:.40}", "temperature")
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be a number in (0, 1], got {top_p!r:.40}", "top_p")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -2**63 <= seed < 2**64):
        raise BadRequest(f"seed must be an integer, got {seed!r:.40}", "seed")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list):
        stops = tuple(stop)
    elif stop is not None:
        raise BadRequest("stop must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOPS or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS or not _encodable(s)
                                     for s in stops):
        raise BadRequest(f"stop must be at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                         "characters", "stop")
    cfg = GenerationConfig(max_new_tokens=min(asked or max_tokens_cap, max_tokens_cap),
                           temperature=0.0 if temperature < 1e-3 else float(temperature), top_p=float(top_p),
                           seed=None if seed is None else seed % 2**64, stop_strings=stops)
    return ChatRequest(messages, cfg, stream, include_usage, asked)


def finish_reason(reason: str) -> str:
    return {"stop": "stop", "stop_string": "stop", "length": "length", "context": "length"}.get(reason, "stop")


def completion(rid: str, model: str, text: str, st) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason(st.finish_reason), "logprobs": None}],
            "usage": usage(st)}


def usage(st) -> dict:
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
            "total_tokens": st.prompt_tokens + st.new_tokens}


def chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
