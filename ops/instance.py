"""The Dagster instance the commands and the demo use: its home under the data directory, and what must be
created once, from one process, before Dagster's processes start."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ops.console import out
from pipeline.config import PROJECT_ROOT, PipelineConfig

if TYPE_CHECKING:
    import dagster as dg


def prepare_dagster_home(cfg: PipelineConfig) -> Path:
    home = cfg.data_path / "dagster"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PROJECT_ROOT / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def prepare_instance(instance: dg.DagsterInstance) -> None:
    """Create once, from one process, what every Dagster process would otherwise create on first use. Run it
    before the webserver, the daemon and any run start.

    - The storage's tables: two processes creating SQLite's at once fail with "table ... already exists".
    - Each concurrency pool the assets use (`gpu`), at dagster.yaml's `pools.default_limit`. Dagster writes a
      pool's limit when a step first asks it for a slot, and again once the default limit has changed. On
      PostgreSQL that write fails on a duplicate key when two runs make it at once, and in every run after the
      default changed (dagster-io/dagster#33552). A limit a person set in the UI is left as it is.
    """
    instance.get_runs(limit=1)
    instance.get_dynamic_partitions("rl_step")
    instance.all_instigator_state()
    default = instance.global_op_concurrency_default_limit
    if default is None:
        return
    from definitions import defs

    storage = instance.event_log_storage
    limits = {limit.name: limit for limit in storage.get_pool_limits()}
    for pool in sorted({defs.resolve_assets_def(key).op.pool for key in defs.resolve_all_asset_keys()} - {None}):
        current = limits.get(pool)
        if current is not None and (current.limit == default or not current.from_default):
            continue
        if current is not None:
            storage.delete_concurrency_limit(pool)  # the update Dagster's own path cannot make on PostgreSQL
        storage.initialize_concurrency_limit_to_default(pool)


def init_instance() -> None:
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        prepare_instance(instance)
        for pool in instance.event_log_storage.get_pool_limits():
            source = "dagster.yaml's default" if pool.from_default else "set by hand"
            out(f"ok: pool {pool.name}: {pool.limit} slot(s), {source}")
