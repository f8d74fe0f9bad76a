"""Deployments on a real swarm (a broker with ``--http-port`` and 2 compnodes as processes): ``fusionnet
deploy``, ``/v1/infer`` equal to plain PyTorch on the bundled examples, greedy ``/v1/completions`` equal to
``transformers``' ``generate()`` token for token (GPT-2 and Llama, prompts of different lengths in one
request), the real ``openai`` client (plain and streaming), 4xx errors, ``status`` and ``undeploy``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fusionnet.job.loader import load_job
from fusionnet.perfmodel.generation_rate import generation_rate
from fusionnet.runtime.deploy import deploy, undeploy
from fusionnet.runtime.process_swarm import BlockingObserver, CompnodeSpec, ProcessSwarm, running_swarm
from fusionnet.serving.client import FusionNetClient, ServingError
from tests.dag_models import token_data
from tests.jobfiles import REPO, example_job, write_job

pytestmark = pytest.mark.swarm
TOL = 1e-5
PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4], [11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessSwarm]:
    workdir = tmp_path_factory.mktemp("serving")
    with running_swarm(workdir, [{}, {}], broker_kw={"extra": BROKER_EXTRA}) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(2)
        finally:
            observer.close()
        yield sw


# The models here take a fraction of a millisecond per batch: whether the performance model splits them
# over 2 compnodes turns on link probes a busy machine skews. These tests are about the pipeline and
# its failover, so the deployments are split over 2 compnodes as the balanced policy does.
BROKER_EXTRA = ["--http-port", "0", "--placement", "balanced"]


def _deploy(sw: ProcessSwarm, job: Path, name: str) -> str:
    reply = asyncio.run(deploy(job, sw.initial_peers, name=name, wait_compnodes=60))
    assert reply.url is not None and reply.compnodes == 2
    return reply.url


def _generate_job(folder: Path, model_class: str, seq: int, **kwargs: object) -> Path:
    ids, _ = token_data(4, seq=seq)
    return write_job(
        folder,
        model_class=model_class,
        model_kwargs=dict(kwargs),
        inputs=ids,
        labels=None,
        task="generate",
        loss=False,  # type: ignore[arg-type]
        batch_size=4,
        microbatches=2,
        compnodes=2,
    )


@pytest.mark.timeout(600)
def test_deploy_infer_examples_equal_plain_pytorch(swarm: ProcessSwarm, tmp_path: Path) -> None:
    url = None
    for example in ("mlp", "figure3"):
        # figure3 names its own cut (an op: Table 3's second sub-DAG begins at var_A's mul)
        cuts = {"cuts": ["mul"]} if example == "figure3" else {}
        path = example_job(example, tmp_path, task="infer", compnodes=2, **cuts)
        try:
            if example == "mlp":  # the command itself once: prints the name and the endpoint URL
                cmd = [sys.executable, "-m", "fusionnet.cli.main", "deploy", str(path), "--name", example,
                       "--initial-peers", *swarm.initial_peers]  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
                assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{swarm.dump_logs()[-4000:]}"
                url = done.stdout.strip().splitlines()[-1]
                assert url.startswith("http://"), done.stdout
            else:
                url = _deploy(swarm, path, example)
            job = load_job(path)
        finally:
            path.unlink()
        client = FusionNetClient(url)
        inputs = job.inputs[:7]  # not a multiple of the micro-batch: the last one is padded
        with torch.no_grad():
            want = job.model.eval()(inputs)
        got = client.infer(inputs, model=example)
        assert got.shape == want.shape and (got - want).abs().max().item() <= TOL
        # several clients at once: their rows share batches, each gets its own rows back
        with torch.no_grad():
            singles = [job.model(job.inputs[i : i + 1]) for i in range(5)]
        for got_one, want_one in zip(asyncio.run(_infer_each(client, job.inputs[:5], example)), singles):
            assert (got_one - want_one).abs().max().item() <= TOL
    assert url is not None
    _check_errors(FusionNetClient(url))
    names = {m["id"] for m in FusionNetClient(url).models()}
    assert names == {"mlp", "figure3"}
    status = _status(swarm)
    assert {d["id"] for d in status["deployments"]} == {"mlp", "figure3"}
    for d in status["deployments"]:  # the performance model's figures for generation_rate
        figures = d["model"]
        assert figures["microbatch_rows"] >= 1 and d["in_flight"] == 2, figures
        assert len(figures["stage_fp_seconds"]) == len(figures["stage_comm_seconds"]) == len(d["peers"])
        assert all(0 < c < 10 for c in figures["stage_fp_seconds"]), figures
        assert all(0 <= r < 10 for r in figures["stage_comm_seconds"]) and figures["call_seconds"] > 0
        fp, comm = figures["stage_fp_seconds"], figures["stage_comm_seconds"]
        rows, call = figures["microbatch_rows"], figures["call_seconds"]
        rate = generation_rate(fp, comm, mb_rows=rows, sessions=4, max_batch=d["max_batch"], in_flight=2,
                               call_seconds=call)  # fmt: skip
        assert rate.pass_seconds >= figures["call_seconds"] + sum(fp) and rate.tokens_per_s > 0
    for name in ("mlp", "figure3"):
        assert asyncio.run(undeploy(name, swarm.initial_peers)).undeployed
    assert FusionNetClient(url).models() == []


@pytest.mark.timeout(600)
def test_a_request_whose_rows_make_the_model_raise_fails_alone(swarm: ProcessSwarm, tmp_path: Path) -> None:
    """An embedding model deployed for ``infer`` (no vocabulary check before batching): a request with a
    token id outside its table makes an op raise on a compnode. It gets 400 naming the error; requests
    sent at the same time get their outputs, and the deployment serves on."""
    ids, _ = token_data(4, seq=8)
    path = write_job(
        tmp_path / "lm", model_class="HFCausalLM", inputs=ids, labels=None, task="infer", loss=False,
        batch_size=4, microbatches=2, compnodes=2,
    )  # fmt: skip
    url = _deploy(swarm, path, "lm")
    try:
        model = load_job(path).model.eval()
        client = FusionNetClient(url)
        with torch.no_grad():
            want = model(ids)
        bad = ids[:1].clone()
        bad[0, 3] = 10**6

        def infer(rows: torch.Tensor) -> torch.Tensor | ServingError:
            try:
                return client.infer(rows, model="lm")
            except ServingError as e:
                return e

        async def together() -> list[torch.Tensor | ServingError]:
            rows = [ids[0:1], bad, ids[1:3], ids[3:4]]
            return await asyncio.gather(*(asyncio.to_thread(infer, r) for r in rows))

        first, refused, middle, last = asyncio.run(together())
        assert isinstance(refused, ServingError) and refused.status == 400, refused
        assert "failed on these inputs" in refused.message and "IndexError" in refused.message
        for got, rows in ((first, slice(0, 1)), (middle, slice(1, 3)), (last, slice(3, 4))):
            assert isinstance(got, torch.Tensor), got
            assert (got - want[rows]).abs().max().item() <= TOL
        again = client.infer(ids, model="lm")  # serving on, on a fresh placement
        assert (again - want).abs().max().item() <= TOL
    finally:
        asyncio.run(undeploy("lm", swarm.initial_peers))


async def _infer_each(client: FusionNetClient, rows: torch.Tensor, name: str) -> list[torch.Tensor]:
    """One request per row, all at once (threads: the client is synchronous)."""
    return await asyncio.gather(
        *(asyncio.to_thread(client.infer, rows[i : i + 1], name) for i in range(len(rows)))
    )


def _check_errors(client: FusionNetClient) -> None:
    cases = [
        (lambda: client.infer(torch.zeros(2, 3), model="mlp"), 400, "inputs"),
        (lambda: client.infer(torch.zeros(2, 16, dtype=torch.float64), model="mlp"), 400, "float64"),
        (lambda: client.infer(torch.zeros(2, 16), model="nope"), 404, "nope"),
        (lambda: client.infer(torch.zeros(2, 16)), 400, "model"),
        (lambda: client.complete([1, 2], model="mlp", max_tokens=2), 400, "not a text generation"),
        (
            lambda: client._open("/v1/infer?model=mlp", b"not safetensors", "application/octet-stream"),
            400,
            "safe",
        ),
        (lambda: client._open("/v1/completions", b"{not json"), 400, "JSON"),
        (lambda: client._open("/v1/nothing"), 404, ""),
    ]
    for call, status, says in cases:
        with pytest.raises(ServingError) as err:
            call()
        assert err.value.status == status and says in err.value.message, err.value


def _status(sw: ProcessSwarm) -> dict:
    observer = BlockingObserver(sw.initial_peers)
    try:
        return observer.broker_status()
    finally:
        observer.close()


def _reference_tokens(job_path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = load_job(job_path, deployment=True).model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.lm.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        out.append(gen[0, len(prompt) :].tolist())
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "model_class,kwargs,seq",
    [("HFCausalLM", {"positions": 32}, 24), ("HFDecoder", {"family": "llama"}, 24)],
    ids=["gpt2", "llama"],
)
def test_greedy_completions_equal_transformers_generate(
    swarm: ProcessSwarm, tmp_path: Path, model_class: str, kwargs: dict, seq: int
) -> None:
    path = _generate_job(tmp_path / "job", model_class, seq, **kwargs)
    name = f"gen-{model_class.lower()}"
    url = _deploy(swarm, path, name)
    try:
        want = _reference_tokens(path, PROMPTS, 6)
        client = FusionNetClient(url)
        (described,) = [m for m in client.models() if m["id"] == name]
        assert described["kv_cache_slots"] == 16 and described["context"] == seq  # KV-cached decoding
        # /v1/infer scores whole sequences (each a prefill in a slot of its own): the model's logits
        ids = torch.randint(1, 40, (2, seq), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            plain = load_job(path, deployment=True).model.eval()(ids)
        assert torch.allclose(client.infer(ids, model=name), plain, atol=1e-4, rtol=1e-4)
        with pytest.raises(ServingError) as refused:  # an id outside the vocabulary would fail a batch
            client.infer(torch.full((1, seq), 10**6, dtype=torch.long), model=name)
        assert refused.value.status == 400 and "outside the vocabulary" in refused.value.message
        # echo, max_tokens 0: a prompt scored (a prefill in a slot), each token's logprob given those before
        prompt = PROMPTS[0]
        scored = client.complete(prompt, model=name, max_tokens=0, echo=True, logprobs=0)["choices"][0]
        padded = torch.tensor([prompt + [0] * (seq - len(prompt))])
        with torch.no_grad():
            logp = torch.log_softmax(load_job(path, deployment=True).model.eval()(padded)[0], dim=-1)
        want_lp = [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert scored["token_ids"] == [] and scored["logprobs"]["token_logprobs"][0] is None
        assert scored["logprobs"]["token_logprobs"][1:] == pytest.approx(want_lp, abs=1e-4)
        reply = client.complete(PROMPTS, model=name, max_tokens=6, temperature=0)
        got = [c["token_ids"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
        assert got == want
        assert reply["usage"]["completion_tokens"] == 18
        # a stop token ends the session early (its cache slot goes back at once): the last new token's
        k = max(i for i in range(6) if want[0][i] not in want[0][:i])
        got = client.complete(
            PROMPTS[0], model=name, max_tokens=6, temperature=0, stop_token_ids=[want[0][k]]
        )
        assert (got["choices"][0]["token_ids"], got["choices"][0]["finish_reason"]) == (want[0][:k], "stop")
        # seeded sampling: the same seed gives the same tokens
        a = client.complete(PROMPTS[0], model=name, max_tokens=5, temperature=0.8, top_p=0.9, seed=3)
        b = client.complete(PROMPTS[0], model=name, max_tokens=5, temperature=0.8, top_p=0.9, seed=3)
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        with pytest.raises(ServingError) as err:
            client.complete([1] * (seq - 2), model=name, max_tokens=5)
        assert err.value.status == 400 and "context window" in err.value.message
        if model_class == "HFCausalLM":
            _check_openai(url, name, want)
        # every sub-DAG's batches went straight to its worker over the data path, none as an RPC
        (deployment,) = [d for d in _status(swarm)["deployments"] if d["id"] == name]
        assert deployment["serve_calls"]["rpc"] == 0 and deployment["serve_calls"]["direct"] > 0, deployment
    finally:
        asyncio.run(undeploy(name, swarm.initial_peers))


def _check_openai(url: str, name: str, want: list[list[int]]) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert name in [m.id for m in client.models.list().data]
    completion = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    assert completion.choices[0].model_extra["token_ids"] == want[1]
    streamed: list[int] = []
    for chunk in client.completions.create(
        model=name, prompt=PROMPTS[2], max_tokens=6, temperature=0, stream=True
    ):
        streamed.extend(chunk.choices[0].model_extra["token_ids"])
    assert streamed == want[2]
    # curl-like: the raw HTTP answer is JSON with the OpenAI shape
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({"model": name, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        doc = json.loads(response.read())
    assert doc["object"] == "text_completion" and doc["choices"][0]["token_ids"] == want[0][:2]


@pytest.mark.timeout(900)
def test_generation_survives_a_compnode_sigkill_with_the_same_tokens(tmp_path: Path) -> None:
    """Both regular compnodes are armed: one SIGKILLs itself in the FP of its 5th batch, the other in its
    8th, mid-generation. The deployment is placed again after each death (on the survivor and the backup,
    then on the backup alone), the failed batch runs again, and the tokens equal ``generate()``'s. Two
    armed nodes keep the kill certain even when a loaded machine made the broker re-place the deployment
    without one of them before its point came."""
    specs = [
        CompnodeSpec(env={"FUSIONNET_FAULT": "fp:7"}),
        CompnodeSpec(env={"FUSIONNET_FAULT": "fp:4"}),
        CompnodeSpec(backup=True),
    ]
    path = _generate_job(tmp_path / "job", "HFCausalLM", 24, positions=32)
    want = _reference_tokens(path, PROMPTS, 10)
    with running_swarm(tmp_path / "swarm", specs, broker_kw={"extra": BROKER_EXTRA}) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(3)
        finally:
            observer.close()
        url = _deploy(sw, path, "gen")
        reply = FusionNetClient(url).complete(PROMPTS, model="gen", max_tokens=10, temperature=0)
        assert [c["token_ids"] for c in reply["choices"]] == want
        logs = sw.dump_logs()
        died = [d.name for d in sw.compnodes[:2] if d.proc.poll() is not None]
        assert died and logs.count("fault injection: SIGKILL") == len(died)
        assert logs.count("placing it again") >= len(died)
        # the sessions' KV caches went with the dead compnode: their batch failed and they replayed
        assert "caches lost" in logs
        deployment = _status(sw)["deployments"][0]
        backup = sw.compnodes[2].peer_id
        assert backup in deployment["peers"]
        assert not {d.peer_id for d in sw.compnodes[:2] if d.name in died} & set(deployment["peers"])


@pytest.mark.timeout(300)
def test_a_deployment_that_lost_every_compnode_answers_at_once_and_comes_back_on_a_new_one(
    tmp_path: Path,
) -> None:
    """Its only compnode SIGKILLed and no backup: each request gets a 503 that says why, at once (not a
    500 after a 120 s wait, as when the failed re-placement left the deployment waiting for good), and the
    deployment stays listed. A compnode that joins later takes it up again, with PyTorch's outputs."""
    path = example_job("mlp", tmp_path, task="infer", compnodes=1)
    job = load_job(path)
    inputs = job.inputs[:3]
    with torch.no_grad():
        want = job.model.eval()(inputs)
    with running_swarm(tmp_path / "swarm", [{}], broker_kw={"extra": BROKER_EXTRA}) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(1)
        finally:
            observer.close()
        reply = asyncio.run(deploy(path, sw.initial_peers, name="mlp", wait_compnodes=60))
        assert reply.url is not None
        client = FusionNetClient(reply.url)
        assert (client.infer(inputs, model="mlp") - want).abs().max().item() <= TOL
        sw.compnodes[0].proc.kill()
        sw.compnodes[0].proc.wait()
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(ServingError) as refused:
                client.infer(inputs, model="mlp")
            assert refused.value.status == 503 and time.monotonic() - started < 30, refused.value
        assert "has no compnodes" in refused.value.message, refused.value
        assert [m["id"] for m in client.models()] == ["mlp"]
        listed = _status(sw)["deployments"][0]
        assert listed["unplaced"] and listed["compnodes"] == 0, "status says it has no placement, and why"
        sw.add_compnode("late")
        deadline = time.monotonic() + 90
        while True:  # each try answers at once: 503 until the broker knows the new compnode
            try:
                got = client.infer(inputs, model="mlp")
                break
            except ServingError as e:
                assert e.status == 503 and time.monotonic() < deadline, e
            time.sleep(0.2)
        assert (got - want).abs().max().item() <= TOL
        assert "placed again" in sw.dump_logs()
        listed = _status(sw)["deployments"][0]
        assert listed["unplaced"] is None and listed["compnodes"] == 1
        kept = tmp_path / "swarm" / "broker.state" / "deployments"
        assert [p.name for p in kept.iterdir()] == [reply.job_id]  # its submitted weights, while deployed
        assert asyncio.run(undeploy("mlp", sw.initial_peers)).undeployed
        assert list(kept.iterdir()) == []  # undeployed: its files go with it
