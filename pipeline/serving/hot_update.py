"""The hot update of a running replica, through vLLM's dev-mode weight-update routes (docs/operating.md names the
version and sources): its requests paused, not dropped, the weights sent in place, checked, resumed.

    POST /init_weight_transfer_engine {"init_info": {}}
    POST /pause?mode=keep                  in-flight requests are held, not dropped
    (a new policy first, when the replica serves another one and the policy is a local directory:)
    POST /start_weight_update              the update targets the policy (the target model)
    POST /update_weights {"update_info": {"path": POLICY_DIR}}
    POST /finish_weight_update {"weight_version": "policy-<dir name>"}
    POST /start_draft_weight_update        the update targets the speculative draft model
    POST /update_weights {"update_info": {"path": DIR}}     the `disk` backend loads DIR
    POST /finish_weight_update {"weight_version": "drafter-v<version>"}
    GET  /weight_info                      must now report "drafter-v<version>", still paused
    POST /resume

A replica without those routes (404/405: not in dev mode, an older vLLM) refuses before anything changes
(HotUpdateUnsupported). An update that fails once weights may have changed never resumes on them: the previous
drafter (and policy) go back in the same pause and the replica resumes on those, or it stays paused for its
caller to restart (HotUpdateFailed).
"""

from __future__ import annotations

import json
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path

from pipeline.serving.drivers import ReplicaSpec, call


class HotUpdateUnsupported(RuntimeError):
    """The replica took no update and is unchanged: it has no weight-update routes (404/405), or refused to
    begin one (/init_weight_transfer_engine or /pause failed, e.g. vLLM without a weight-transfer backend)."""


class HotUpdateFailed(RuntimeError):
    """A weight-update call failed after the replica was paused: its weights may have changed. The replica was
    not resumed on them: `rolled_back` when the weights it had are back in place and it serves again, else it is
    still paused, for its caller to restart."""

    def __init__(self, message: str, rolled_back: bool = False) -> None:
        super().__init__(message)
        self.rolled_back = rolled_back


class _Unchanged(RuntimeError):
    """Inside a paused update: refused before any weight was sent."""


@dataclass(frozen=True)
class Weights:
    """What a paused session sends: a drafter version's checkpoint, after the policy in `policy_dir` if given."""

    drafter_dir: str
    version: str
    policy_dir: str | None = None


def weight_version(version: str) -> str:
    """What the fleet commits as vLLM's `weight_version` for a drafter version, and reads back from /weight_info."""
    return f"drafter-v{version}"


def _dev_call(replica: ReplicaSpec, path: str, body: dict | None = None, timeout: float = 300.0) -> dict:
    """A dev-mode route; HotUpdateUnsupported when the server does not have it, HotUpdateFailed on any other
    error (the server's own message kept)."""
    try:
        raw = call(replica, path, body, timeout)
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 405):
            raise HotUpdateUnsupported(f"{path} answered HTTP {exc.code}") from None
        detail = exc.read().decode(errors="replace")[:300]
        raise HotUpdateFailed(f"{path} answered HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise HotUpdateFailed(f"{path}: {exc}") from None
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        raise HotUpdateFailed(f"{path} answered with no JSON object") from None


def _send_drafter(replica: ReplicaSpec, drafter_dir: str, label: str, start: str = "/start_draft_weight_update"
                  ) -> None:
    """One weight-update session on a paused replica: start (the draft model's, or with
    `/start_weight_update` the policy's), the checkpoint, finish under `label`."""
    _dev_call(replica, start, {})
    _dev_call(replica, "/update_weights", {"update_info": {"path": str(Path(drafter_dir).resolve())}})
    _dev_call(replica, "/finish_weight_update", {"weight_version": label})


def policy_version(policy_dir: str) -> str:
    """The `weight_version` a policy sent in place is committed under."""
    return f"policy-{Path(policy_dir).name}"


def _send_paused(replica: ReplicaSpec, weights: Weights) -> None:
    """`weights` to a paused replica, then its /weight_info checked, still paused: the replica is resumed only on
    weights it reports. _Unchanged when it has no route for a policy update (nothing sent), HotUpdateFailed when
    anything failed once a weight may have been sent."""
    try:
        if weights.policy_dir is not None:
            try:
                _dev_call(replica, "/start_weight_update", {})
            except HotUpdateUnsupported as exc:  # nothing sent yet: unchanged, it takes the restart
                raise _Unchanged(f"{exc}: the policy cannot be sent in place") from None
            _dev_call(replica, "/update_weights", {"update_info": {"path": str(Path(weights.policy_dir).resolve())}})
            _dev_call(replica, "/finish_weight_update", {"weight_version": policy_version(weights.policy_dir)})
        _send_drafter(replica, weights.drafter_dir, weight_version(weights.version))
        reported = _dev_call(replica, "/weight_info").get("weight_version")
    except HotUpdateUnsupported as exc:
        raise HotUpdateFailed(f"{exc} after /pause succeeded") from None
    if reported != weight_version(weights.version):
        raise HotUpdateFailed(f"/weight_info reports {reported!r} after the update, not "
                              f"{weight_version(weights.version)!r}")


def hot_update(replica: ReplicaSpec, drafter_dir: str, version: str, policy_dir: str | None = None,
               restore: Weights | None = None) -> float:
    """Pause the replica (requests held, not dropped), send it the policy in `policy_dir` (when given) and the
    drafter in `drafter_dir`, check it reports `version`, resume; returns the seconds its requests were held.

    A held request never decodes on a failed update: once a weight may have been sent, a failure puts `restore`
    (the weights the replica had) back while it is still paused and resumes it on them (HotUpdateFailed with
    `rolled_back`); with no `restore`, or when that fails too, the replica stays paused (HotUpdateFailed) for the
    caller to restart. HotUpdateUnsupported when it refused before anything changed (resumed, unchanged)."""
    paused = _pause(replica)
    try:
        _send_paused(replica, Weights(drafter_dir, version, policy_dir))
    except _Unchanged as exc:
        _resume(replica, str(exc))
        raise HotUpdateUnsupported(str(exc)) from None
    except HotUpdateFailed as exc:
        if restore is None:
            raise HotUpdateFailed(f"{exc}; the replica stays paused") from None
        try:
            _send_paused(replica, restore)
        except (HotUpdateFailed, _Unchanged) as again:
            raise HotUpdateFailed(f"{exc}; putting version {restore.version} back failed too ({again}): the replica "
                                  "stays paused") from None
        _resume(replica, str(exc))
        raise HotUpdateFailed(f"{exc}; version {restore.version} put back before the replica resumed",
                              rolled_back=True) from None
    _resume(replica)
    return time.monotonic() - paused


def _resume(replica: ReplicaSpec, failure: str = "") -> None:
    try:
        _dev_call(replica, "/resume", {})
    except (HotUpdateFailed, HotUpdateUnsupported) as exc:
        raise HotUpdateFailed(f"{f'{failure}; ' if failure else ''}/resume failed, the replica may hold its "
                              f"requests: {exc}") from None


def _pause(replica: ReplicaSpec) -> float:
    """The replica paused, its requests held (its clock time then); HotUpdateUnsupported when it refuses."""
    try:
        _dev_call(replica, "/init_weight_transfer_engine", {"init_info": {}})
        _dev_call(replica, "/pause?mode=keep", {})
    except HotUpdateFailed as exc:
        raise HotUpdateUnsupported(str(exc)) from None
    return time.monotonic()


def send_policy(replica: ReplicaSpec, policy_dir: str) -> float:
    """The policy in `policy_dir` in place on a running replica, alone (its drafter stays): paused (requests held),
    sent, resumed; /weight_info must then report the policy's label. Returns the seconds requests were held.
    HotUpdateUnsupported when it refused before anything changed; HotUpdateFailed otherwise."""
    paused = _pause(replica)
    try:
        _send_drafter(replica, policy_dir, policy_version(policy_dir), start="/start_weight_update")
    finally:
        _dev_call(replica, "/resume", {})
    held = time.monotonic() - paused
    reported = _dev_call(replica, "/weight_info").get("weight_version")
    if reported != policy_version(policy_dir):
        raise HotUpdateFailed(f"/weight_info reports {reported!r} after the policy update, not "
                              f"{policy_version(policy_dir)!r}")
    return held
