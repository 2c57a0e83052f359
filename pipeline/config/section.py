"""What every configuration section shares: its base (unknown keys refused, values frozen), and the check that
keeps secrets out of the configuration (they come from the environment: a URI names no credentials)."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A configuration section: a key it does not know is refused, and its values never change once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def no_credentials(uri: str, where: str, query_names: frozenset[str] = frozenset(), fix: str = "") -> str:
    """Secrets come from the environment only: a URI with user:password@, or a token in its query string
    (`?token=`, a presigned `?X-Amz-Signature=`) or fragment, would put them in config, logs and metadata.
    `query_names` are the query parameters that carry no secret and are accepted; `fix` says where the secret
    goes instead (`ENV_SECRETS[where]` when empty). The message names the key and never repeats the URI or the
    value."""
    fix = fix or ENV_SECRETS[where]
    parts = urlsplit(uri)
    if "@" in parts.netloc:
        raise ValueError(f"{where} must not carry credentials (user:password@); {fix}")
    names = [name.split("=", 1)[0] for name in parts.query.split("&") if name]
    if any(name.lower() not in query_names for name in names) or ("?" in uri and not names):
        accepted = f" (accepted: {', '.join(sorted(query_names))})" if query_names else ""
        raise ValueError(f"{where} must not carry credentials in a query string{accepted}; {fix}")
    if parts.fragment or "#" in uri:
        raise ValueError(f"{where} must not carry a fragment ('#...'), where a token could hide; {fix}")
    return uri


_S3_SECRETS = "S3 keys come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
ENV_SECRETS = {
    "storage.root": _S3_SECRETS,
    "storage.endpoint_url": _S3_SECRETS,
    "storage.checkpoint_prefixes": _S3_SECRETS,
    "mlflow.tracking_uri": "use MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD "
                           "(a database's password: PGPASSWORD or ~/.pgpass)",
    "drafter.warm_start": f"it names a local directory; {_S3_SECRETS}",
    "hidden_states.vllm_path": "it names a local directory",
}

# Connection settings of a database tracking URI (postgresql://host/db?sslmode=require) that hold no secret.
TRACKING_QUERY_NAMES = frozenset({"sslmode", "sslrootcert", "sslcert", "connect_timeout", "application_name",
                                  "target_session_attrs"})
