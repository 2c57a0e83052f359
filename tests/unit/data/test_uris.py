"""The policy pointer's checkpoint_uri (pipeline.data.uris): only keys under the store root and URIs
under allowed prefixes are opened; credentials are refused and never shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.data.keys import policy_pointer_key
from pipeline.data.rollouts import read_policy_pointer
from pipeline.data.store import ObjectStore
from pipeline.data.uris import UriPolicy, UriPolicyError, check_uri, redact
from pipeline.models import target as target_lib

ROOT = "file:///srv/store"
POLICY = UriPolicy(allowed_prefixes=("s3://checkpoints/rl",), allow_http=False)
SECRET = "hunter2-Secret"


def _bad(name: str, uri: str) -> object:
    return pytest.param(uri, id=name, marks=pytest.mark.reliability("bad_input", f"checkpoint_uri {name}"))


BAD = [
    _bad("leaving the store root (../..)", "../../etc"),
    _bad("leaving the store root inside a key (policies/../../x)", "policies/../../x"),
    _bad("leaving the store root from a full URI (root/../..)", f"{ROOT}/../../etc/passwd"),
    _bad("an absolute path", "/etc/passwd"),
    _bad("on another filesystem (file:///)", "file:///etc/passwd"),
    _bad("a sibling of the store root (prefix without a separator)", "file:///srv/store-evil/ckpt"),
    _bad("a bucket not allowed (s3://other)", "s3://other-bucket/ckpt"),
    _bad("a sibling of an allowed prefix (s3://checkpoints/rl-evil)", "s3://checkpoints/rl-evil/ckpt"),
    _bad("over http from any host", "http://attacker.example/ckpt"),
    _bad("over https from any host", "https://attacker.example/ckpt"),
    _bad("with user:password@", f"s3://admin:{SECRET}@checkpoints/rl/ckpt"),
    _bad("with a token in the query string", f"s3://checkpoints/rl/ckpt?X-Amz-Signature={SECRET}"),
    _bad("with a token in the fragment", f"s3://checkpoints/rl/ckpt#{SECRET}"),
    _bad("with user info and no scheme (user:pw@host/x)", f"admin:{SECRET}@host/ckpt"),
    _bad("with a percent-escaped .. (%2e%2e)", "s3://checkpoints/rl/%2e%2e/other"),
    _bad("with a backslash", "policies\\..\\..\\etc"),
    _bad("with a control character", "policies/step\x00/ckpt"),
    _bad("empty", ""),
    _bad("with an empty segment (//)", "s3://checkpoints/rl//ckpt"),
    _bad("with another scheme on a key (c:/x)", "c:/windows"),
]


@pytest.mark.parametrize("uri", BAD)
def test_checkpoint_uris_outside_the_policy_are_refused_without_the_secret(uri: str) -> None:
    with pytest.raises(UriPolicyError, match="refused|empty") as caught:
        check_uri(uri, ROOT, POLICY, where="policy.json: field checkpoint_uri")
    assert SECRET not in str(caught.value)
    assert str(caught.value).startswith("policy.json: field checkpoint_uri")


@pytest.mark.parametrize(("uri", "full"), [
    ("policies/run/step-000001", f"{ROOT}/policies/run/step-000001"),
    (f"{ROOT}/policies/run/step-000001", f"{ROOT}/policies/run/step-000001"),
    ("s3://checkpoints/rl/run/step-000001", "s3://checkpoints/rl/run/step-000001"),
])
def test_keys_and_uris_under_allowed_prefixes_resolve(uri: str, full: str) -> None:
    assert check_uri(uri, ROOT, POLICY) == full


def test_http_only_when_allowed_and_under_a_prefix() -> None:
    allowed = UriPolicy(allowed_prefixes=("https://models.internal/rl",), allow_http=True)
    assert check_uri("https://models.internal/rl/step-1", ROOT, allowed) == "https://models.internal/rl/step-1"
    with pytest.raises(UriPolicyError, match="not under"):
        check_uri("https://attacker.example/rl/step-1", ROOT, allowed)
    with pytest.raises(UriPolicyError, match="allow_http"):
        check_uri("https://models.internal/rl/step-1", ROOT, UriPolicy(("https://models.internal/rl",)))


@pytest.mark.parametrize("uri", [
    f"s3://admin:{SECRET}@b/k", f"https://h/k?token={SECRET}", f"https://h/k?a=1#{SECRET}",
    f"admin:{SECRET}@h/k", f"s3://b/k#x@{SECRET}y", f"s3://a@b:{SECRET}@c/k",
])
def test_redact_hides_every_credential_form(uri: str) -> None:
    assert SECRET not in redact(uri)


@pytest.mark.reliability("security", "credentials in policy.json's checkpoint_uri: refused at read, in no message, "
                                     "no manifest, no fetch")
@pytest.mark.parametrize("uri", [f"s3://admin:{SECRET}@checkpoints/rl/ckpt",
                                 f"policies/r/step-000001?token={SECRET}", f"https://bot:{SECRET}@attacker.example/ckpt"])
def test_a_pointer_with_credentials_is_refused_everywhere_without_echo(tmp_path: Path, uri: str) -> None:
    store = ObjectStore((tmp_path / "store").as_uri(), uri_policy=POLICY)
    key = policy_pointer_key("r", 1)
    store.write_json(key, {"schema_version": 1, "policy_version": 1, "checkpoint_uri": uri, "model_id": "m"})
    for attempt in (lambda: read_policy_pointer(store, "r", 1), lambda: target_lib.load_policy(store, uri),
                    lambda: store.filesystem(uri)):
        with pytest.raises(UriPolicyError) as caught:
            attempt()
        assert SECRET not in str(caught.value)
        assert SECRET not in repr(caught.value.args)
    assert "field checkpoint_uri" in str(pytest.raises(UriPolicyError, read_policy_pointer, store, "r", 1).value)
    assert [k for k, _, _ in store.list_files("")] == [key]  # nothing fetched, nothing written


def test_store_keys_still_resolve_and_open(store: ObjectStore) -> None:
    store.write_bytes("policies/r/step-000001/config.json", json.dumps({"hidden_size": 8}).encode())
    fs, path = store.filesystem(store.resolve("policies/r/step-000001"))
    assert json.loads(fs.cat_file(f"{path}/config.json")) == {"hidden_size": 8}
