"""The production stores on one machine, for real: an MLflow tracking server whose runs and registry live in
PostgreSQL and whose artefacts live in an S3 bucket (moto's S3-compatible server), with the deploy phase's
registration and promotion gate against it, and a model loaded back from ``models:/NAME@champion`` out of the bucket.

Every service is started here and stopped afterwards (tests/services.py). The DVC remote on S3 and the scheduled
Prefect run on a worker are in tests/test_flow.py (they reuse its tiny pipeline run and its Prefect server); the
two-node DeepSpeed launch is in tests/test_train_nodes.py.
"""

from __future__ import annotations

import json

import pytest

from deploy_support import ENV, ROLL, build_project, deploy_config, nudged_policy, snapshot, tracking_uri
from services import mlflow_server, postgres, postgres_missing, s3_keys, s3_server

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.services,
              pytest.mark.skipif(postgres_missing() is not None, reason=str(postgres_missing()))]
BUCKET = "agentrl-mlflow"


def run_deploy(project, name: str, **over) -> dict:
    from pipeline.deploy.main import deploy

    cfg = deploy_config(project, name, precisions=["fp32", "int8"], **over)
    return deploy(cfg, ENV, ROLL, project / "metrics", project / "metrics" / "deploy.json")


@pytest.mark.slow
def test_deploy_and_gate_on_a_postgresql_store_with_s3_artefacts_and_the_champion_loads_from_the_bucket(
        tmp_path_factory):
    import boto3
    import mlflow.pyfunc
    import psycopg

    from pipeline.deploy.registry import ModelRegistry

    project = build_project(tmp_path_factory.mktemp("scale_project"))
    logs = tmp_path_factory.mktemp("scale_logs")
    name = "policy-scale"
    with postgres() as db, s3_server(BUCKET) as s3, \
            mlflow_server(db, f"s3://{BUCKET}/artifacts", logs, s3_endpoint=s3) as uri, tracking_uri(uri):
        registry = ModelRegistry(name)
        first = run_deploy(project, name)  # v1: no champion yet, promoted on the absolute checks
        assert first["version"] == "1" and first["decision"].passed
        assert registry.alias_version("champion") == "1" and registry.alias_version("challenger") == "1"
        # v2: other weights that play the same episodes: paired against v1 on the same tasks, promoted
        second = run_deploy(project, name, policy=nudged_policy(project, project / "p2", 1e-6))
        assert second["version"] == "2" and second["decision"].passed
        assert registry.alias_version("champion") == "2" and registry.alias_version("challenger") == "2"
        assert registry.history() == ["1", "2"] and registry.tags("2")["gate.decision"] == "promoted"
        before = snapshot(registry)

        # the registry is in PostgreSQL: the versions and the aliases are rows there
        with psycopg.connect(db.replace("postgresql+psycopg://", "postgresql://")) as conn:
            rows = conn.execute("SELECT version FROM model_versions WHERE name = %s ORDER BY version", (name,))
            assert [r[0] for r in rows] == [1, 2]
            aliases = dict(conn.execute("SELECT alias, version FROM registered_model_aliases WHERE name = %s",
                                        (name,)).fetchall())
            assert aliases == {"champion": 2, "challenger": 2}

        # the champion loads back from the registry and plays a task; its files came out of the bucket
        model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
        task = json.loads((project / "data/tasks/test.jsonl").read_text().splitlines()[0])
        (out,) = model.predict([task])
        assert isinstance(out["success"], bool) and out["n_calls"] >= 1
        source = registry.client.get_model_version(name, "2").source  # proxied: the server maps it to the bucket
        assert source.startswith("mlflow-artifacts:/"), source
        mine = s3_keys(s3, BUCKET, "artifacts/" + source.removeprefix("mlflow-artifacts:/").strip("/") + "/")
        assert any(k.endswith("/MLmodel") for k in mine) and any("weights" in k or "safetensors" in k for k in mine), mine
        # proof that nothing else serves them: without its objects in the bucket, the champion no longer loads
        bucket = boto3.resource("s3", endpoint_url=s3).Bucket(BUCKET)
        bucket.delete_objects(Delete={"Objects": [{"Key": k} for k in mine]})
        with pytest.raises(Exception):
            mlflow.pyfunc.load_model(f"models:/{name}@champion")
        assert snapshot(registry) == before  # reading never moved an alias
