"""A local CPU STAND-IN for a vLLM replica (not vLLM): the embedded default fleet and what tests use.

It loads the same drafter checkpoint directory vLLM would and the step's target, and speaks
the endpoints a deploy gates on, with vLLM's paths, fields and metric names:

    GET  /health            200 once the models are loaded
    GET  /v1/models         {"data": [{"id": <served model name>, ...}]}
    POST /v1/completions    {"model", "prompt": [token ids], "max_tokens"} -> greedy text, real
                            speculative decoding with this project's drafter code
    GET  /metrics           vllm:spec_decode_* counters (Prometheus text)

Prompts are token ids (the stand-in has no tokenizer). With an API key (read from the
environment variable named by --api-key-env) /v1/* require `Authorization: Bearer <key>`.

    python -m pipeline.serving.standin_replica --port 8101 --target file:///.../policy --drafter /.../drafter
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from pipeline.evaluation import speculative
from pipeline.models import target as target_lib
from pipeline.models.checkpoint import load_drafter
from pipeline.serving.metrics import SpecCounters, render


class Replica:
    """The models and counters behind the HTTP handler; one request decodes at a time."""

    def __init__(self, target_uri: str, drafter_dir: str | None, k: int, model_name: str) -> None:
        self.model_name, self.k = model_name, k
        self.target = target_lib.load_checkpoint(target_uri)
        self.new_proposer = None  # one proposer per request: it holds that request's cache
        if drafter_dir:
            drafter = load_drafter(Path(drafter_dir), self.target.config.num_hidden_layers)
            drafter.attach(self.target)
            self.new_proposer = speculative.follow_target(drafter, self.target)
        self.counters = SpecCounters(accepted_per_position={j: 0.0 for j in range(k)})
        self._lock = threading.Lock()

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor(prompt, dtype=torch.int64)
        with self._lock:
            if self.new_proposer is None:
                return speculative.greedy_generate(self.target, ids, max_tokens)
            trace = speculative.speculative_generate(self.target, self.new_proposer, ids, max_tokens, self.k)
            c = self.counters
            rounds = trace.accepted_per_round
            self.counters = SpecCounters(
                drafts=c.drafts + len(rounds),
                draft_tokens=c.draft_tokens + len(rounds) * self.k,
                accepted=c.accepted + sum(rounds),
                accepted_per_position={j: c.accepted_per_position[j] + sum(a > j for a in rounds)
                                       for j in range(self.k)},
            )
            return trace.tokens


def make_handler(replica: Replica, api_key: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "drafter-standin-replica"

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: dict) -> None:
            self._send(status, json.dumps(obj).encode())

        def _authorized(self) -> bool:
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._json(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"", "text/plain")
            elif self.path == "/metrics":
                self._send(200, render(replica.counters, replica.model_name).encode(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                if self._authorized():
                    self._json(200, {"object": "list", "data": [
                        {"id": replica.model_name, "object": "model", "owned_by": "stand-in replica (not vLLM)"}]})
            else:
                self._json(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._json(404, {"error": f"no route {self.path}"})
                return
            if not self._authorized():
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                prompt, max_tokens = body["prompt"], int(body.get("max_tokens", 16))
                if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                    raise ValueError("prompt must be a non-empty list of token ids (the stand-in has no tokenizer)")
                if body.get("model") != replica.model_name:
                    raise ValueError(f"model {body.get('model')!r} is not served here ({replica.model_name!r})")
            except (ValueError, KeyError, json.JSONDecodeError) as exc:
                self._json(400, {"error": str(exc)})
                return
            tokens = replica.complete(prompt, max_tokens)
            self._json(200, {
                "id": f"cmpl-{time.time_ns()}", "object": "text_completion", "model": replica.model_name,
                "choices": [{"index": 0, "text": " ".join(map(str, tokens)), "token_ids": tokens,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens)},
            })

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Local CPU stand-in for a vLLM replica (not vLLM).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", required=True, help="policy checkpoint directory URI")
    parser.add_argument("--drafter", default="", help="drafter checkpoint directory (none: plain decoding)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--served-model-name", default="policy")
    parser.add_argument("--api-key-env", default="", help="environment variable holding the API key")
    args = parser.parse_args(argv)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    replica = Replica(args.target, args.drafter or None, args.num_speculative_tokens, args.served_model_name)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(replica, api_key))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
