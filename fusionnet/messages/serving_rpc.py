"""Deployments on the wire: the broker's ``deploy``/``undeploy``/``deployments`` methods and the
compnode's ``serve_step`` (one request batch through a resident sub-DAG), with ``ServingClient``.

A deployment is a long-lived ``infer`` placement: ``deploy`` carries a submission (IR, state, example
data, run spec) like ``submit_job``, plus the deployment's name, kind (``infer`` or ``generate``) and its
batching settings. The broker assigns the sub-DAGs with the ordinary ``assign`` and then drives
``serve_step`` calls whose data comes with the call instead of from the assigned dataset.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from fusionnet.dag.channel import MAX_IN_FLIGHT
from fusionnet.messages.auth import SubmitterAuth, submission_digest
from fusionnet.messages.base import Caller, JobId, Message, TypedCaller
from fusionnet.messages.broker_rpc import SubmitJobRequest

# Deployment names go into URLs and the OpenAI ``model`` field: a conservative alphabet.
DEPLOYMENT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DEPLOYMENT_NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
DeploymentName = Annotated[str, Field(pattern=DEPLOYMENT_NAME)]
MAX_PICKS = 1 << 16


class ServingSettings(Message):
    """How a deployment batches requests (``fusionnet.serving.batching``)."""

    max_wait_ms: Annotated[float, Field(ge=0.0, le=10_000.0)] = 5.0  # a batch waits this long to fill
    queue_limit: Annotated[int, Field(ge=1, le=1 << 20)] = 1024  # rows waiting; beyond: 503
    # batches in the pipeline at once (at most the steps a compnode's mailbox takes ahead of its own)
    in_flight: Annotated[int, Field(ge=1, le=MAX_IN_FLIGHT)] = 2
    # generate, a ``transformers`` causal LM: sessions with a KV cache on the compnodes (0: none, every
    # token recomputes the window)
    kv_slots: Annotated[int, Field(ge=0, le=4096)] = 16


class KvCache(Message):
    """A generate deployment traced as a ``job.kv_decode.SlotDecoder``: rows are (token, position,
    slot), ``slots`` sessions' caches live on the compnodes, positions run below ``window``."""

    slots: Annotated[int, Field(ge=1, le=4096)]
    window: Annotated[int, Field(ge=1, le=1 << 20)]


class DeployRequest(Message):
    name: DeploymentName
    kind: Literal["infer", "generate"]
    submission: SubmitJobRequest  # its spec's task is infer: compnodes run the forward pass only
    settings: ServingSettings = ServingSettings()
    tokenizer: dict[str, bytes] | None = None  # files of the model folder's tokenizer (generate)
    # text data (``data.path: *.txt``): token id -> character, the job's own tokenizer (generate)
    vocab: Annotated[list[Annotated[str, Field(max_length=16)]], Field(max_length=1 << 20)] | None = None
    kv: KvCache | None = None  # generate: decoding with KV caches on the compnodes
    # generate: the ids that end a text (the causal LM's generation config); ids outside the
    # vocabulary, which a toy config may name, are dropped by the broker
    eos_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] = []
    # the submitter's signature (``messages.auth``), scope "deploy", subject ``deploy_subject``: the
    # broker takes deployments from the submitters it takes jobs from, and only they undeploy them
    auth: SubmitterAuth | None = None


def deploy_subject(request: DeployRequest) -> str:
    """What a deploy signature covers: the name and the submission's digest (spec, IR, state, data)."""
    sub = request.submission
    spec = sub.spec.model_dump(mode="json")
    return f"{request.name}:{submission_digest(spec, sub.ir, sub.state, sub.data, sub.request_id or '')}"


class DeployReply(Message):
    name: str
    job_id: JobId
    compnodes: int
    url: str | None = None  # the broker's HTTP endpoint, when it serves one


class UndeployRequest(Message):
    name: DeploymentName
    auth: SubmitterAuth | None = None  # scope "undeploy", subject the name: its deployer's key


class UndeployReply(Message):
    name: str
    undeployed: bool
    message: str = ""


class DeploymentsRequest(Message):
    pass


class DeploymentsReply(Message):
    deployments: list[dict[str, Any]]
    url: str | None = None


class ServeStepRequest(Message):
    """One batch of ``sizes`` rows per micro-batch: ``data`` holds ``"<micro-batch>/<field>"`` tensors
    for the sub-DAGs that read placeholders (empty for the others); ``pick`` (optional, per row of the
    batch) keeps only that position of dimension 1 of every output (a causal LM's logits at each
    row's last token); ``keep`` (optional, per row) says which rows' outputs come back: the others
    are answered only with the argmax of their (picked) first output, in ``ServeStepReply.ids``. A
    greedy session needs its token, not 50k logits, and a prefill's rows but the last need nothing."""

    job_id: JobId
    step: Annotated[int, Field(ge=0)]
    sizes: Annotated[list[Annotated[int, Field(ge=1, le=1 << 20)]], Field(min_length=1, max_length=4096)]
    data: bytes = b""
    pick: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PICKS)] | None = None
    keep: Annotated[list[bool], Field(max_length=MAX_PICKS)] | None = None


class ServeStepReply(Message):
    step: Annotated[int, Field(ge=0)]
    fp_seconds: Annotated[float, Field(ge=0.0)] = 0.0
    # the sub-DAG that holds the model's output: "<micro-batch>/<leaf>" (with ``keep``: its rows only)
    outputs: bytes | None = None
    ids: bytes | None = None  # with ``keep``: "<micro-batch>/0", every row's argmax of its first output


class ServingClient(TypedCaller):
    """Typed calls of deployments: to the broker (deploy, undeploy, deployments) and to compnodes."""

    def __init__(self, call: Caller) -> None:
        super().__init__(call)

    async def call_deploy(self, peer: str, request: DeployRequest, **kw: Any) -> DeployReply:
        return await self.call_typed(peer, "deploy", request, DeployReply, **kw)

    async def call_undeploy(self, peer: str, request: UndeployRequest, **kw: Any) -> UndeployReply:
        return await self.call_typed(peer, "undeploy", request, UndeployReply, **kw)

    async def call_deployments(self, peer: str, request: DeploymentsRequest, **kw: Any) -> DeploymentsReply:
        return await self.call_typed(peer, "deployments", request, DeploymentsReply, **kw)

    async def call_serve_step(self, peer: str, request: ServeStepRequest, **kw: Any) -> ServeStepReply:
        return await self.call_typed(peer, "serve_step", request, ServeStepReply, **kw)
