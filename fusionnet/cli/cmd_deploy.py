"""``fusionnet deploy JOB.yaml --initial-peers ... [--name NAME]`` and ``fusionnet undeploy NAME``.

``deploy`` traces the job's model here, places it on the swarm's compnodes as a resident deployment
(task ``infer``: any model; ``generate``: a causal LM whose forward returns logits), prints its name and
the broker's HTTP endpoint, and exits; the deployment lives on the swarm until ``undeploy``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path
from typing import Any

from fusionnet.cli.argtypes import add_initial_peers, seconds
from fusionnet.cli.jobflags import add_job_loading_flags, add_key_flag
from fusionnet.dag.channel import MAX_IN_FLIGHT
from fusionnet.messages.serving_rpc import DEPLOYMENT_NAME, DEPLOYMENT_NAME_RULE


def _name(text: str) -> str:
    if not re.fullmatch(DEPLOYMENT_NAME, text):  # fullmatch: "$" also matches before a final "\n"
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: {DEPLOYMENT_NAME_RULE}")
    return text


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "deploy",
        help="place a model on the swarm and keep it resident (HTTP API on the broker)",
        description="Traces the job's model here and deploys it: the broker places its sub-DAGs on compnodes "
        "and keeps them resident, serving POST /v1/infer (task infer) or the OpenAI-compatible "
        "POST /v1/completions (task generate) on its --http-port. Prints the deployment name and the "
        "endpoint URL, then exits.",
    )
    p.add_argument("job", type=Path, help="job definition file (YAML), task infer or generate")
    add_initial_peers(p)
    p.add_argument("--name", type=_name, help="deployment name (default: the job's name)")
    p.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        metavar="MS",
        help="a batch waits this long to fill (default 5)",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        choices=tuple(range(1, MAX_IN_FLIGHT + 1)),
        default=2,
        help="request batches in the pipeline at once (default 2: the next batch runs in the first stages "
        "while one is in the last; 1 keeps every session in one fuller batch; as many as the deployment "
        "has compnodes keeps every stage busy under a steady load of requests)",
    )
    p.add_argument(
        "--queue-limit",
        type=int,
        default=1024,
        metavar="ROWS",
        help="rows waiting at most; beyond, requests get 503 (default 1024)",
    )
    p.add_argument(
        "--kv-slots",
        type=int,
        default=16,
        metavar="N",
        help="generate, a transformers causal LM: keep the KV caches of up to N sessions on the compnodes "
        "that hold the layers (more sessions wait for a slot); 0 = no cache, every token recomputes the "
        "context window (default 16)",
    )
    p.add_argument(
        "--wait-compnodes",
        type=seconds,
        default=60.0,
        metavar="S",
        help="wait this long for compnodes (default 60)",
    )
    # --allow-outside-paths and --load-timeout as plan, run and submit have them: the job's model code is
    # loaded in a bounded child first, and its paths (the tokenizer's too) stay in the job folder
    add_job_loading_flags(p)
    add_key_flag(p)
    p.set_defaults(func=run)
    u = subparsers.add_parser(
        "undeploy",
        help="release a deployment's compnodes",
        description="Ends deployment NAME (deployed with this --key) and releases its compnodes. Exit 2 when "
        "this key has no deployment of that name, 1 when no broker answers or the undeploy failed.",
    )
    u.add_argument("name", type=_name, help="deployment name")
    add_initial_peers(u)
    add_key_flag(u)  # the key that deployed it
    u.set_defaults(func=run_undeploy)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from fusionnet.errors import JobError
    from fusionnet.messages.serving_rpc import ServingSettings
    from fusionnet.runtime.deploy import deploy

    given = {"max_wait_ms": args.max_wait_ms, "queue_limit": args.queue_limit, "kv_slots": args.kv_slots}
    try:
        settings = ServingSettings(**given, in_flight=args.in_flight)
    except ValidationError as e:  # a flag out of its range: say which, as argparse would
        err = e.errors()[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-")
        raise JobError(f"{flag}: {err['msg']} (got {err.get('input')!r})") from None
    reply = asyncio.run(
        deploy(
            args.job,
            args.initial_peers,
            name=args.name,
            settings=settings,
            allow_outside_paths=args.allow_outside_paths,
            load_timeout=args.load_timeout,
            wait_compnodes=args.wait_compnodes,
            key_path=args.key,
        )
    )
    print(f"deployed {reply.name} (job {reply.job_id}) on {reply.compnodes} compnodes")
    print(reply.url if reply.url else "the broker serves no HTTP API (start it with --http-port)")
    return 0


def run_undeploy(args: argparse.Namespace) -> int:
    from fusionnet.runtime.deploy import undeploy

    reply = asyncio.run(undeploy(args.name, args.initial_peers, args.key))
    print(reply.message or f"{reply.name} undeployed")
    return 0 if reply.undeployed else 1
