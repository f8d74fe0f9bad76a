"""Who may deploy and undeploy: the submitters the broker takes jobs from, by the same signatures
(``messages.auth``). A deploy unsigned, signed for another deployment or by a key the broker does not take
work from is refused before anything is accepted; only the key that deployed a model undeploys it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fusionnet.broker.admission import Admission, AdmissionConfig
from fusionnet.broker.deployments import DeploymentService
from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.messages.auth import public_bytes, submitter_id
from fusionnet.messages.serving_rpc import DeployRequest, UndeployRequest, deploy_subject
from fusionnet.runtime.submit import submission_payload
from fusionnet.runtime.submitter import Signer

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent
BROKER, CALLER = "12D3KooWBroker", "12D3KooWCaller"


def _service(tmp_path: Path, allowed: list[Ed25519PrivateKey]) -> tuple[DeploymentService, list[str]]:
    listed = tmp_path / "submitters.txt"
    listed.write_text("".join(submitter_id(public_bytes(k)) + "\n" for k in allowed))
    admission = Admission.create(AdmissionConfig(submitters_file=listed), ["/ip4/0.0.0.0/tcp/0"])
    store = SimpleNamespace(get_job=lambda job_id: {"submitter": owners[-1]})
    context = SimpleNamespace(broker_id=lambda: BROKER, store=store, refresh_job_metrics=lambda: None)
    service = DeploymentService(context, serving=None, admission=admission)  # type: ignore[arg-type]
    owners: list[str] = []

    async def deployed(name: str, request: Any, submitter: str) -> str:  # past the signature: accepted
        owners.append(submitter)
        return submitter

    service._deploy = deployed  # type: ignore[method-assign,assignment]
    return service, owners


def test_only_a_listed_submitters_signature_for_this_deployment_deploys(tmp_path: Path) -> None:
    mine, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    service, owners = _service(tmp_path, [mine])
    submission = submission_payload(
        load_job(REPO / "examples/mlp/infer.yaml", deployment=True), deployment=True
    )
    request = DeployRequest(name="mlp", kind="infer", submission=submission)
    context = SimpleNamespace(method="deploy", remote_peer=CALLER)
    deploy = DeploymentService.rpc_deploy.__wrapped__  # type: ignore[attr-defined]

    def signed(key: Ed25519PrivateKey, subject: str, caller: str = CALLER) -> DeployRequest:
        return request.model_copy(update={"auth": Signer(key, BROKER, caller).auth("deploy", subject)})

    async def scenario() -> None:
        with pytest.raises(JobError, match="not signed by a submitter key"):
            await deploy(service, request, context)
        with pytest.raises(JobError, match="may not submit to this broker"):
            await deploy(service, signed(stranger, deploy_subject(request)), context)
        other = request.model_copy(update={"name": "other"})
        with pytest.raises(JobError, match="signature"):  # signed for another deployment
            await deploy(service, signed(mine, deploy_subject(other)), context)
        with pytest.raises(JobError, match="signature"):  # for another connection's caller
            await deploy(service, signed(mine, deploy_subject(request), caller="12D3KooWElse"), context)
        assert owners == []
        assert await deploy(service, signed(mine, deploy_subject(request)), context) == submitter_id(
            public_bytes(mine)
        )

    asyncio.run(scenario())


def test_only_the_key_that_deployed_a_model_undeploys_it(tmp_path: Path) -> None:
    mine, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    service, owners = _service(tmp_path, [mine, other])
    owners.append(submitter_id(public_bytes(mine)))

    class _Batcher:
        async def close(self) -> None:
            pass

    service.served["mlp"] = SimpleNamespace(batcher=_Batcher(), job_id="j1")  # type: ignore[assignment]
    context = SimpleNamespace(method="undeploy", remote_peer=CALLER)
    undeploy = DeploymentService.rpc_undeploy.__wrapped__  # type: ignore[attr-defined]

    def signed(key: Ed25519PrivateKey) -> UndeployRequest:
        return UndeployRequest(name="mlp", auth=Signer(key, BROKER, CALLER).auth("undeploy", "mlp"))

    async def scenario() -> None:
        with pytest.raises(JobError, match="not signed"):
            await undeploy(service, UndeployRequest(name="mlp"), context)
        with pytest.raises(JobError, match="no deployment named 'mlp' deployed with this key"):
            await undeploy(service, signed(other), context)
        assert "mlp" in service.served
        assert (await undeploy(service, signed(mine), context)).undeployed
        assert "mlp" not in service.served

    asyncio.run(scenario())
