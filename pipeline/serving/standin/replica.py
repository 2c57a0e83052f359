"""A local CPU STAND-IN for a vLLM replica (not vLLM): the embedded default fleet and what tests use.

It loads the same drafter checkpoint directory vLLM would and the step's target, and speaks
the endpoints a deploy gates on, with vLLM's paths, fields and metric names:

    GET  /health            200 once the models are loaded
    GET  /v1/models         {"data": [{"id": <served model name>, ...}]}
    POST /v1/completions    {"model", "prompt": [token ids], "max_tokens", "temperature", "top_p", "top_k",
                            "seed", "stop_token_ids", "logprobs", "return_token_ids"} (vLLM's request fields
                            and defaults: temperature 1.0) -> an OpenAI completion; concurrent requests decode
                            in one batch, joining and leaving it between speculative rounds (engine.py)
    GET  /metrics           vllm:spec_decode_* counters (Prometheus text), and the stand-in's own
                            standin:speculative_batch_threshold and standin:rounds_total

With VLLM_SERVER_DEV_MODE=1 in its environment, as vLLM, it also serves the dev-mode routes a hot
update of the drafter uses (vLLM's `vllm/entrypoints/serve/dev/rlhf/api_router.py`, with the request
bodies of its `disk` weight-transfer backend; docs/operating.md names the sources):

    POST /init_weight_transfer_engine   {"init_info": {}}
    POST /pause?mode=keep               the running batch freezes between rounds, queued requests wait
    POST /start_weight_update           a weight update of the target (the policy) begins
    POST /start_draft_weight_update     a weight update of the draft model begins
    POST /update_weights                {"update_info": {"path": DIR}}: the checkpoint in DIR (the policy's
                                        or the drafter's, as the session began) is loaded in place (as
                                        vLLM's, not transactional); a new policy carries the drafter over
    POST /finish_weight_update          {"weight_version": LABEL}: the update is committed under LABEL
    POST /resume                        held requests decode, on the new weights
    GET  /is_paused                     {"is_paused": bool}
    GET  /weight_info                   {"weight_version": LABEL or null}

Without dev mode those answer 404, as a vLLM server started without it does. Two routes are the
stand-in's own, for tests (vLLM has neither):

    GET  /standin/requests   {"completed", "failed", "cancelled", "held", "in_flight"}: completions counted
    POST /standin/faults     {"update_weights": N}: the next N /update_weights load the new weights
                             into the drafter, then fail with 500 (a partial update)

Prompts are token ids (the stand-in has no tokenizer: a completion's text is its token ids joined by
spaces, it stops only at `stop_token_ids`, and `logprobs` holds the sampled token's raw logprob alone, so at
most `"logprobs": 1` is served). Every completion carries the stand-in's own `standin` object (vLLM has none):
the /weight_info label when it finished, the policy that decoded it, and whether the policy changed while it
ran (`straddles_policy_update`). With an API key (read from the environment variable named by --api-key-env)
every route but /health and /metrics requires `Authorization: Bearer <key>`: the control routes above and the
stand-in's own included (vLLM's own key check covers /v1/* only; docs/production.md says what the fleet
requires of it).

No client can stall or fail the others: a completion whose prompt plus `max_tokens` exceeds the policy's context
(`max_position_embeddings`, vLLM's max_model_len) is refused with 400 before it is admitted, in vLLM's error shape
(`{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`), so no prompt is too large to prefill
beside the others; a request whose client disconnects stops decoding (it leaves the batch before the next round);
and the listen backlog holds a burst of connections as large as the batch (vLLM's server accepts them alike).

    python -m pipeline.serving.standin.replica --port 8101 --target file:///.../policy --drafter /.../drafter
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import select
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from pipeline.evaluation import speculative
from pipeline.evaluation.scheduler import SpeculationThreshold
from pipeline.models import target as target_lib
from pipeline.models.checkpoint import CheckpointError, load_drafter
from pipeline.models.drafter import Proposer
from pipeline.sampling import DRAFT_SAMPLE_METHODS, DraftSampleMethod
from pipeline.serving.hot_update import policy_version
from pipeline.serving.metrics import SpecCounters, render, render_standin
from pipeline.serving.standin.completions import ServedModel, completion_request, completion_response, error_body
from pipeline.serving.standin.engine import Cancelled, Completion, Engine

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
PUBLIC_ROUTES = ("/health", "/metrics")  # with an API key, every other route asks for it
PAUSE_MODES = ("abort", "wait", "keep")
LISTEN_BACKLOG = 1024  # connections the kernel holds before they are accepted: a burst of a whole batch's clients
CLIENT_POLL_S = 0.25  # how often a waiting completion checks that its client is still connected
CLIENT_TIMEOUT_S = 60  # a client silent this long while it sends its request is dropped (its thread freed)


class UpdateError(RuntimeError):
    """A weight-update call out of order or with a body the backend refuses (HTTP 400 or 500)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class RequestCounts:
    """Completions seen by this replica: what a test reads to say none was lost during an update."""

    completed: int = 0
    failed: int = 0
    cancelled: int = 0  # their clients disconnected before they finished: they stopped decoding
    held: int = 0  # waited for a /resume: queued when the pause began, or arrived while paused
    in_flight: int = 0


class Replica:
    """The models, the engine, the counters and the weight-update session behind the HTTP handler. Requests
    decode in the engine's batch; a pause freezes it between rounds until /resume."""

    def __init__(self, target_uri: str, drafter_dir: str | None, k: int, model_name: str,
                 draft_method: DraftSampleMethod = "greedy", speculation_max_batch: int | None = None,
                 max_num_seqs: int = 256) -> None:
        self.model_name, self.k, self.drafter_dir = model_name, k, drafter_dir
        self.target = target_lib.load_checkpoint(target_uri)
        # The engine makes one proposer per batch (it holds that batch's draft cache) with the loaded drafter.
        self.new_proposer = self._load(drafter_dir) if drafter_dir else None
        self.engine = Engine(self.target, self.new_proposer, k, draft_method,
                             SpeculationThreshold(speculation_max_batch), policy_version(target_uri), max_num_seqs)
        self.requests = RequestCounts()
        self.faults = {"update_weights": 0}
        self._state = threading.Lock()  # counts, the pause flag and the update session
        self._pausing = threading.Lock()  # one /pause or /resume at a time
        self._paused = False
        self._session: str | None = None  # None, "started" or "loaded"
        self._session_model = "draft"  # what the open session updates: "draft" or "policy"

    def _load(self, drafter_dir: str) -> Callable[[], Proposer]:
        drafter = load_drafter(Path(drafter_dir), self.target.config.num_hidden_layers)
        drafter.attach(self.target)
        return speculative.follow_target(drafter, self.target)

    # -- serving ---------------------------------------------------------------------------------------------

    @property
    def weight_version(self) -> str | None:
        return self.engine.weight_version

    @property
    def counters(self) -> SpecCounters:
        return self.engine.counters

    @property
    def max_model_len(self) -> int:
        """The policy's context: a request's prompt and its tokens together (vLLM's max_model_len)."""
        return int(self.target.config.max_position_embeddings)

    def served_model(self) -> ServedModel:
        return ServedModel(self.model_name, self.target.config.vocab_size, self.max_model_len,
                           self.engine.model.device)

    def complete(self, request: speculative.Request, client_gone: Callable[[], bool] = lambda: False) -> Completion:
        """Decode `request` in the engine's batch; when `client_gone()` says its client has left, it is cancelled
        (raises `Cancelled`) and stops decoding."""
        with self._state:
            self.requests.in_flight += 1
            self.requests.held += self._paused
        future = self.engine.submit(request)
        try:
            while True:
                try:
                    completion = future.result(timeout=CLIENT_POLL_S)
                    break
                except TimeoutError:
                    if client_gone():
                        self.engine.cancel(future)
        except Cancelled:
            with self._state:
                self.requests.in_flight -= 1
                self.requests.cancelled += 1
            raise
        except Exception:
            with self._state:
                self.requests.in_flight -= 1
                self.requests.failed += 1
            raise
        with self._state:
            self.requests.in_flight -= 1
            self.requests.completed += 1
        return completion

    def request_counts(self) -> RequestCounts:
        with self._state:
            return RequestCounts(**asdict(self.requests))

    # -- pause and resume ------------------------------------------------------------------------------------

    def pause(self, mode: str) -> None:
        """`keep` and `wait` alike: the running batch freezes between rounds and queued requests wait until
        /resume. `abort` is not implemented: nothing here is dropped."""
        if mode not in PAUSE_MODES:
            raise UpdateError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        if mode == "abort":
            raise UpdateError(400, "the stand-in pauses with mode=keep or mode=wait only")
        with self._pausing:
            if self.paused:
                return
            self.engine.pause()
            with self._state:
                self._paused = True
                # The requests running or queued are held from now on; arrivals while paused count themselves.
                self.requests.held += self.requests.in_flight

    def resume(self) -> None:
        with self._pausing:
            if not self.paused:
                return
            with self._state:
                self._paused = False
            self.engine.resume()

    @property
    def paused(self) -> bool:
        with self._state:
            return self._paused

    # -- the draft weight update -----------------------------------------------------------------------------

    def start_weight_update(self, model: str = "policy") -> None:
        """A session updating the target (`policy`) or the draft model (`draft`)."""
        with self._state:
            if model == "draft" and self.new_proposer is None:
                raise UpdateError(500, "no speculative draft model is configured")
            if self._session is not None:
                raise UpdateError(500, "start_weight_update called while a weight update is already in progress")
            self._session, self._session_model = "started", model

    def start_draft_weight_update(self) -> None:
        self.start_weight_update("draft")

    def update_weights(self, update_info: object) -> None:
        """vLLM's `disk` backend: one complete safetensors checkpoint per session, from an absolute directory."""
        with self._state:
            session = self._session
        if session != "started":
            self._abort()
            raise UpdateError(500, "start_weight_update must be called before loading a checkpoint"
                              if session is None else "the disk backend accepts exactly one checkpoint per session")
        path = update_info.get("path") if isinstance(update_info, dict) else None
        if not isinstance(path, str) or not Path(path).is_absolute() or not Path(path).is_dir():
            self._abort()
            raise UpdateError(400, "update_info.path must be an absolute local directory")
        if not any(p.suffix == ".safetensors" for p in Path(path).iterdir()):
            self._abort()
            raise UpdateError(400, f"Shared-disk checkpoint directory contains no safetensors files: {path}")
        try:
            if self._session_model == "policy":
                self._load_policy(path)
            else:
                self.new_proposer, self.drafter_dir = self._load(path), path
                self.engine.reload(self.target, self.new_proposer, policy_changed=False)
        except (CheckpointError, OSError, ValueError, KeyError, RuntimeError) as exc:
            self._abort()
            raise UpdateError(500, f"loading {path}: {exc}") from None
        with self._state:
            failing = self.faults["update_weights"] > 0
            self.faults["update_weights"] -= failing
        if failing:
            self._abort()
            raise UpdateError(500, "stand-in fault: update_weights failed after loading (a partial update)")
        with self._state:
            self._session = "loaded"

    def _load_policy(self, path: str) -> None:
        """The target's weights from DIR in place; the drafter it serves follows the new target (its shared
        embedding and head are the target's). Requests decode with both from now on."""
        target = target_lib.load_checkpoint(Path(path).as_uri())
        proposer = None
        if self.drafter_dir:
            drafter = load_drafter(Path(self.drafter_dir), target.config.num_hidden_layers)
            drafter.attach(target)
            proposer = speculative.follow_target(drafter, target)
        self.target, self.new_proposer = target, proposer
        self.engine.reload(target, proposer, policy_changed=True)
        self.engine.label(policy_version=policy_version(path))

    def finish_weight_update(self, weight_version: str | None) -> None:
        with self._state:
            session, self._session = self._session, None
            if session is None:
                raise UpdateError(500, "No shared-disk weight update is active")
            if session != "loaded":
                raise UpdateError(500, "No checkpoint was loaded during the shared-disk update session")
        if weight_version is not None:
            self.engine.label(weight_version=weight_version)

    def fail_updates(self, count: int) -> int:
        """The stand-in's fault switch: the next `count` /update_weights load their checkpoint, then fail."""
        with self._state:
            self.faults["update_weights"] = count
            return count

    def _abort(self) -> None:
        with self._state:
            self._session = None


class StandInHandler(BaseHTTPRequestHandler):
    """The stand-in's routes over HTTP; `make_handler` binds them to a replica, its API key and dev mode."""

    server_version = "drafter-standin-replica"
    timeout = CLIENT_TIMEOUT_S
    replica: Replica
    api_key: str | None = None
    dev_mode = False

    # -- the exchange ----------------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode())

    def _authorized(self) -> bool:
        """Every route but PUBLIC_ROUTES needs the key: the control routes pause serving and load weights."""
        if urlsplit(self.path).path in PUBLIC_ROUTES or not self.api_key:
            return True
        given = self.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def _body(self) -> dict:
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = json.loads(raw) if raw else {}
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        return body

    def _route(self, routes: dict[str, Callable[[], None]]) -> None:
        if not self._authorized():
            return
        route = routes.get(urlsplit(self.path).path)
        if route is None:
            self._json(404, {"detail": "Not Found"})
        else:
            route()

    def do_GET(self) -> None:
        routes = {"/health": self._health, "/metrics": self._metrics, "/v1/models": self._models,
                  "/standin/requests": self._request_counts}
        if self.dev_mode:
            routes |= {"/is_paused": self._is_paused, "/weight_info": self._weight_info}
        self._route(routes)

    def do_POST(self) -> None:
        routes = {"/v1/completions": self._completion, "/standin/faults": self._faults}
        if self.dev_mode:
            routes |= {path: partial(self._dev_route, handle) for path, handle in DEV_ROUTES.items()}
        self._route(routes)

    def log_message(self, *args: object) -> None:
        pass

    # -- GET routes ------------------------------------------------------------------------------------------

    def _health(self) -> None:
        self._send(200, b"", "text/plain")

    def _metrics(self) -> None:
        engine = self.replica.engine
        page = render(engine.counters, self.replica.model_name) + render_standin(
            engine.threshold.threshold, engine.rounds, self.replica.model_name)
        self._send(200, page.encode(), "text/plain; version=0.0.4")

    def _models(self) -> None:
        self._json(200, {"object": "list", "data": [
            {"id": self.replica.model_name, "object": "model", "owned_by": "stand-in replica (not vLLM)"}]})

    def _request_counts(self) -> None:
        self._json(200, asdict(self.replica.request_counts()))

    def _is_paused(self) -> None:
        self._json(200, {"is_paused": self.replica.paused})

    def _weight_info(self) -> None:
        self._json(200, {"weight_version": self.replica.weight_version})

    # -- POST routes -----------------------------------------------------------------------------------------

    def _completion(self) -> None:
        try:
            body = self._body()
            request, wants = completion_request(body, self.replica.served_model())
        except KeyError as exc:
            self._json(400, error_body(400, f"missing field {exc}"))
            return
        except (ValueError, TypeError, json.JSONDecodeError) as exc:
            self._json(400, error_body(400, str(exc)))
            return
        try:
            done = self.replica.complete(request, self._client_gone)
        except Cancelled:
            return  # no one is left to answer
        except Exception as exc:  # noqa: BLE001 - the round failed: the client may send it elsewhere
            self._json(500, error_body(500, f"decoding failed: {exc}"))
            return
        self._json(200, completion_response(self.replica.model_name, request, wants, done))

    def _client_gone(self) -> bool:
        """Whether the client closed its connection: readable with nothing to read (an HTTP client sends
        nothing more while it waits for its answer)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _faults(self) -> None:
        try:
            count = int(self._body().get("update_weights", 0))
        except (ValueError, TypeError, json.JSONDecodeError) as exc:
            self._json(400, {"error": str(exc)})
            return
        self._json(200, {"update_weights": self.replica.fail_updates(count)})

    def _dev_route(self, handle: Callable[[Replica, dict, dict], dict]) -> None:
        """A dev-mode route, answered in the shape of vLLM's FastAPI errors."""
        try:
            body = self._body()
            message = handle(self.replica, body, parse_qs(urlsplit(self.path).query))
        except json.JSONDecodeError:
            self._json(400, {"detail": "Invalid JSON format"})
        except ValueError as exc:
            self._json(400, {"detail": str(exc)})
        except UpdateError as exc:
            self._json(exc.status, {"detail": str(exc)})
        else:
            self._json(200, message)


def make_handler(replica: Replica, api_key: str | None, dev_mode: bool) -> type[BaseHTTPRequestHandler]:
    """The handler class of a server for `replica` (http.server makes a handler of it per connection)."""
    return type("Handler", (StandInHandler,), {"replica": replica, "api_key": api_key, "dev_mode": dev_mode})


def _init(replica: Replica, body: dict, query: dict) -> dict:
    if body.get("init_info") is None:
        raise ValueError("Missing 'init_info' in request body")
    return {"message": "Weight transfer initialized"}


def _pause(replica: Replica, body: dict, query: dict) -> dict:
    replica.pause(query.get("mode", ["abort"])[0])
    return {"status": "paused"}


def _resume(replica: Replica, body: dict, query: dict) -> dict:
    replica.resume()
    return {"status": "resumed"}


def _start(replica: Replica, body: dict, query: dict) -> dict:
    replica.start_weight_update("policy")
    return {"message": "Weight update started"}


def _start_draft(replica: Replica, body: dict, query: dict) -> dict:
    replica.start_draft_weight_update()
    return {"message": "Draft weight update started"}


def _update(replica: Replica, body: dict, query: dict) -> dict:
    if body.get("update_info") is None:
        raise ValueError("Missing 'update_info' in request body")
    replica.update_weights(body["update_info"])
    return {"message": "Weights updated"}


def _finish(replica: Replica, body: dict, query: dict) -> dict:
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ValueError("weight_version must be a string")
    replica.finish_weight_update(version)
    return {"message": "Weight update finished"}


DEV_ROUTES: dict[str, Callable[[Replica, dict, dict], dict]] = {
    "/init_weight_transfer_engine": _init,
    "/pause": _pause,
    "/resume": _resume,
    "/start_weight_update": _start,
    "/start_draft_weight_update": _start_draft,
    "/update_weights": _update,
    "/finish_weight_update": _finish,
}


class StandInServer(ThreadingHTTPServer):
    """A thread per connection; the backlog holds a burst of clients (socketserver's default of 5 resets the
    connections past it), and a connection's thread does not keep the process alive."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Local CPU stand-in for a vLLM replica (not vLLM).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", required=True, help="policy checkpoint directory URI")
    parser.add_argument("--drafter", default="", help="drafter checkpoint directory (none: plain decoding)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--served-model-name", default="policy")
    parser.add_argument("--api-key-env", default="", help="environment variable holding the API key")
    parser.add_argument("--draft-sample-method", choices=DRAFT_SAMPLE_METHODS, default="greedy",
                        help="how the drafter picks its tokens (vLLM's draft_sample_method)")
    parser.add_argument("--speculation-max-batch", default="auto",
                        help="the largest batch whose rounds speculate: `auto` (measured) or a number")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="requests decoding at once at most")
    args = parser.parse_args(argv)
    # The fleet stops a replica with SIGTERM. An ignored signal stays ignored through exec, and a replica started
    # from a process that ignores SIGINT (a job a shell put in the background) ignores SIGTERM too once Dagster maps
    # SIGTERM onto SIGINT's handler there: without the defaults back, every stop waits out its SIGKILL fallback.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    dev_mode = os.environ.get(DEV_MODE_ENV, "") not in ("", "0")
    fixed = None if args.speculation_max_batch == "auto" else int(args.speculation_max_batch)
    replica = Replica(args.target, args.drafter or None, args.num_speculative_tokens, args.served_model_name,
                      args.draft_sample_method, fixed, args.max_num_seqs)
    server = StandInServer((args.host, args.port), make_handler(replica, api_key, dev_mode))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
