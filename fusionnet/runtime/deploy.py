"""``fusionnet deploy`` / ``undeploy`` from the user's machine: trace the model here (user code runs only
on the deployer's machine, as for ``submit``), send the submission as a deployment, wait until the broker
has placed it; or ask the broker to release one.

The tokenizer of a ``generate`` deployment is the model folder's (the weights folder when
``model.weights`` is one, else the job file's folder): its JSON/text files travel with the deployment,
each one inside the job folder after symlinks unless ``--allow-outside-paths``.

Before the job is loaded here, it is loaded once in a child process under ``--load-timeout``, as
``plan``, ``run`` and ``submit`` do (``runtime.loadcheck``): model code that loops at import, exits or
crashes the interpreter ends ``deploy`` with one line (exit 2) instead of hanging it or ending it
silently.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from fusionnet.dht.node import check_initial_peers
from fusionnet.errors import JobError
from fusionnet.job.kv_decode import SlotDecoder, disagreement, example_rows, find_causal_lm, sliding_span
from fusionnet.job.loader import LoadedJob, check_job_without_model, load_job
from fusionnet.job.parse import load_job_spec
from fusionnet.messages.broker_rpc import BrokerClient
from fusionnet.messages.serving_rpc import (
    DEPLOYMENT_NAME,
    DEPLOYMENT_NAME_RULE,
    DeployReply,
    DeployRequest,
    KvCache,
    ServingClient,
    ServingSettings,
    UndeployReply,
    UndeployRequest,
    deploy_subject,
)
from fusionnet.runtime.jobcontrol import DEFAULT_WAIT_COMPNODES, wait_for_compnodes
from fusionnet.runtime.loadcheck import (
    DEFAULT_LOAD_TIMEOUT,
    check_job_loads,
)
from fusionnet.runtime.submit import submission_payload
from fusionnet.runtime.submitter import Signer, load_or_create_key
from fusionnet.serving.tokenizers import tokenizer_files

DEPLOY_TIMEOUT = 300.0  # the broker answers once the sub-DAGs are assigned
UNDEPLOY_TIMEOUT = 60.0


def with_kv_cache(
    job: LoadedJob, slots: int, stream: TextIO = sys.stderr
) -> tuple[LoadedJob, KvCache | None]:
    """The job with its ``transformers`` causal LM wrapped for KV-cached decoding (``SlotDecoder``):
    the example's sequence length becomes the context window, the example rows (token, position,
    slot). A model without exactly one such LM, or whose outputs are not that LM's logits, is deployed
    as it is (every token recomputes the window; said on ``stream``)."""
    lm = find_causal_lm(job.model)
    if lm is None:
        return job, None
    if job.inputs.dim() != 2 or job.inputs.dtype not in (torch.long, torch.int32):
        raise JobError(
            f"generate: the example data must be token ids [batch, sequence], got {list(job.inputs.shape)}"
        )
    window = int(job.inputs.shape[1])
    try:
        sliding_span(lm, window)
    except JobError as e:  # layers of two kinds of attention: served, without caches
        print(f"deploy: no KV caches: {e}; every token recomputes the context window", file=stream)
        return job, None
    decoder = SlotDecoder(lm, slots, window).eval()
    why = disagreement(job.model.eval(), decoder, job.inputs[:1].to(torch.long))
    if why is not None:
        print(f"deploy: no KV caches: {why}; every token recomputes the context window", file=stream)
        return job, None
    rows = example_rows(int(job.inputs.shape[0]), job.inputs, slots)
    return replace(job, model=decoder, inputs=rows), KvCache(slots=slots, window=window)


def end_of_text_ids(model: nn.Module) -> list[int]:
    """The ids that end a text for ``model``'s ``transformers`` causal LM (its generation config's
    ``eos_token_id``, else its config's): none for other models."""
    lm = find_causal_lm(model)
    if lm is None:
        return []
    ids = getattr(getattr(lm, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(getattr(lm, "config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted({i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0})[:64]


def model_folder(job: LoadedJob) -> Path:
    weights = job.spec.model.weights
    if weights is not None and (job.base_dir / weights).is_dir():
        return (job.base_dir / weights).resolve()
    return job.base_dir


def check_deployment_loads(job_path: Path, *, allow_outside_paths: bool, timeout: float) -> None:
    """Loads the job once, as a deployment, in the load check's child process (``runtime.loadcheck``),
    bounded by ``timeout`` seconds; one ``JobError`` when loading it fails, exits, crashes or takes
    longer (``deploy`` then says so in one line, exit 2)."""
    check_job_without_model(job_path, allow_outside_paths=allow_outside_paths, deployment=True)
    check_job_loads(job_path, allow_outside_paths=allow_outside_paths, timeout=timeout, deployment=True)


async def deploy(
    job_path: Path,
    initial_peers: Sequence[str],
    *,
    name: str | None = None,
    settings: ServingSettings | None = None,
    allow_outside_paths: bool = False,
    load_timeout: float = DEFAULT_LOAD_TIMEOUT,
    wait_compnodes: float = DEFAULT_WAIT_COMPNODES,
    stream: TextIO = sys.stderr,
    key_path: Path | None = None,
) -> DeployReply:
    """``key_path``: the submitter key the broker knows this user by (``runtime.submitter``); the
    deployment is this key's, and only it undeploys it. ``load_timeout``: the bound on loading the
    job's model in the child process that checks it first (``check_deployment_loads``)."""
    from fusionnet.daemon.observer import SwarmObserver

    # what can be told wrong now is, before the model is traced and shipped (seconds to minutes)
    check_initial_peers(initial_peers)
    spec = load_job_spec(job_path)
    if spec.task not in ("infer", "generate"):
        raise JobError(f"{job_path}: task: a deployment's task is infer or generate, not {spec.task!r}")
    name = name or spec.name
    if not re.fullmatch(DEPLOYMENT_NAME, name):  # fullmatch: "$" also matches before a final "\n"
        why = f"deployment name {name[:80]!r} (the job's): {DEPLOYMENT_NAME_RULE}; give one with --name"
        raise JobError(why)
    kind = spec.task
    settings = settings or ServingSettings()
    # the model code runs here only once a bounded child has loaded it: it cannot hang or end deploy
    # (in this thread, not asyncio.to_thread: Ctrl-C must end the check, and its child, at once)
    check_deployment_loads(job_path, allow_outside_paths=allow_outside_paths, timeout=load_timeout)
    job = load_job(job_path, allow_outside_paths=allow_outside_paths, deployment=True)
    tokenizer = None
    if kind == "generate":  # before tracing: a tokenizer file outside the job folder is refused at once
        tokenizer = await asyncio.to_thread(
            tokenizer_files, model_folder(job), job_folder=job.base_dir, allow_outside=allow_outside_paths
        )
    kv = None
    eos = end_of_text_ids(job.model) if kind == "generate" else []
    if kind == "generate" and settings.kv_slots:
        job, kv = with_kv_cache(job, settings.kv_slots, stream)
    submission = await asyncio.to_thread(submission_payload, job, deployment=True)
    request = DeployRequest(
        name=name,
        kind=kind,
        submission=submission,
        settings=settings,
        tokenizer=tokenizer,
        vocab=job.vocab if kind == "generate" and tokenizer is None else None,
        kv=kv,
        eos_token_ids=eos,
    )
    key = load_or_create_key(key_path)
    subject = await asyncio.to_thread(deploy_subject, request)
    async with SwarmObserver(initial_peers) as observer:
        broker = await observer.find_broker()
        auth = Signer(key, broker, observer.peer_id).auth("deploy", subject)
        request = request.model_copy(update={"auth": auth})
        await wait_for_compnodes(
            BrokerClient(observer.call), broker, submission.spec.compnodes, wait_compnodes, stream
        )
        return await ServingClient(observer.call).call_deploy(broker, request, timeout=DEPLOY_TIMEOUT)


async def undeploy(name: str, initial_peers: Sequence[str], key_path: Path | None = None) -> UndeployReply:
    """Ends deployment ``name``, signed with the submitter key that deployed it."""
    from fusionnet.daemon.observer import SwarmObserver

    check_initial_peers(initial_peers)
    key = load_or_create_key(key_path)
    async with SwarmObserver(initial_peers) as observer:
        broker = await observer.find_broker()
        auth = Signer(key, broker, observer.peer_id).auth("undeploy", name)
        request = UndeployRequest(name=name, auth=auth)
        return await ServingClient(observer.call).call_undeploy(broker, request, timeout=UNDEPLOY_TIMEOUT)
