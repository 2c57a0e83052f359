"""Which URIs a trainer-written pointer may name, and how a URI is shown.

`policy.json`'s checkpoint_uri comes from the RL trainer, on the other side of a trust
boundary, and the pipeline fetches and loads what it names. It may be:

* a key relative to the store root (`policies/<run>/step-000123`), or
* a full URI under the store root or under one of the configured allowed prefixes;
  http(s) only when explicitly allowed.

The check here is lexical; on a `file://` store the path must also resolve, symlinks followed,
under the store root or a local allowed prefix (ObjectStore.filesystem, local_files.py).

Credentials are never accepted anywhere in a URI (user:password@, a query string that may
carry a token, a fragment): they would be echoed into logs, asset metadata, the Dagster run
database and the shard manifest. Messages about a refused URI show it redacted, never whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HTTP_SCHEMES = ("http", "https")
# Characters no checkpoint path needs, and which let a URI mean something else than it reads:
# percent-escapes (%2e%2e is ..), backslashes, whitespace and control characters.
_SUSPECT = re.compile(r"[%\\\s\x00-\x1f\x7f]")


class UriPolicyError(ValueError):
    """A URI the policy refuses; the message shows it redacted."""


@dataclass(frozen=True)
class UriPolicy:
    allowed_prefixes: tuple[str, ...] = ()  # full URIs (directories); the store root is always allowed
    allow_http: bool = False


def redact(uri: str) -> str:
    """`uri` with anything that could be a secret replaced by `***`: whatever precedes an '@' (user
    info), a query string and a fragment."""
    head, sep, rest = uri.partition("://") if "://" in uri else ("", "", uri)
    cuts = [i for i in (rest.find("?"), rest.find("#")) if i >= 0]
    tail = "?***" if cuts else ""
    rest = rest[: min(cuts)] if cuts else rest
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return head + sep + rest + tail


def _segments_ok(path: str) -> bool:
    return all(s not in ("", ".", "..") for s in path.rstrip("/").split("/"))


def _refuse(uri: str, where: str, why: str) -> UriPolicyError:
    return UriPolicyError(f"{where}: {redact(uri)!r} refused: {why}")


def _relative_ok(uri: str, relative: str, where: str) -> None:
    """What a pointer adds to a trusted root or prefix: plain path segments only."""
    if _SUSPECT.search(relative):
        raise _refuse(uri, where, "percent-escapes, backslashes, whitespace and control characters are not accepted")
    if not _segments_ok(relative):
        raise _refuse(uri, where, "the path must not have '.', '..' or empty segments")


def check_uri(uri: str, store_root: str, policy: UriPolicy, where: str = "checkpoint_uri") -> str:
    """The full URI `uri` names (a key resolved under `store_root`), or UriPolicyError.

    `where` names the file and field in the message."""
    if not isinstance(uri, str) or not uri:
        raise UriPolicyError(f"{where}: empty or not a string")
    if any(c in uri for c in "@?#"):
        raise _refuse(uri, where, "credentials are not accepted in a URI (user info, query string, fragment); "
                                  "the reader takes them from its environment")
    if "://" not in uri:
        if uri.startswith("/") or ":" in uri.split("/", 1)[0]:
            raise _refuse(uri, where, "a key must be relative to the store root")
        _relative_ok(uri, uri, where)
        return f"{store_root.rstrip('/')}/{uri}"
    scheme = uri.split("://", 1)[0].lower()
    if scheme in HTTP_SCHEMES and not policy.allow_http:
        raise _refuse(uri, where, "http(s) checkpoints need storage.allow_http_checkpoints")
    for prefix in (store_root, *policy.allowed_prefixes):
        base = prefix.rstrip("/")
        if uri.startswith(base + "/"):
            _relative_ok(uri, uri[len(base) + 1:], where)
            return uri
    raise _refuse(uri, where, "not under the store root or a prefix in storage.checkpoint_prefixes")
