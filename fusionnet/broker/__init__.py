"""The broker daemon: job intake, the compnode registry, placement and supervision of running jobs.

It calls the planner (``fusionnet.planning``) and holds no planning code of its own.

Map of the package:

- ``daemon.py``       ``Broker``: DHT announcement, registry, heartbeats, the job service, shutdown.
- ``registry.py``     the compnodes as the broker sees them: DHT records merged with heartbeats.
- ``jobs.py``         job intake RPCs: ``upload_state``, ``submit_job``, ``job_status``, ``job_results``,
                      ``cancel_job``.
- ``uploads.py``      a submission's state uploaded in chunks before the submission that names it.
- ``admission.py``    who may submit (``--submitters`` / ``--open-submissions``), per-submitter quotas,
                     a job's details and results for its submitter only.
- ``submission.py``   a job as received, and the checks a submission passes before it is accepted.
- ``jobrun.py``       one job from plan to results: steps, syncs, failover, hand-over.
- ``job_placement.py``  placing a job: plan, adopt, assign every sub-DAG (a mixin of ``JobRun``).
- ``job_steps.py``  driving steps: the step calls (or sent ahead) and their replies into metrics (a mixin).
- ``placement_review.py``  between steps: elastic growth, re-plans on a misprediction, link probes.
- ``config.py``       ``BrokerConfig``: the broker's flags, validated.
- ``context.py``      ``JobContext``: what a job run may use of the broker (store, registry, books, client).
- ``replanning.py``   ``Replan``: why and how a job's placement changes, as a value; the pure decisions.
- ``job_calls.py``    a job run's typed calls to its compnodes (assign, step, collect, release, probe).
- ``assignment_payloads.py``  what each compnode of a placement is sent in ``assign``.
- ``failures.py``     noticing that a job lost a compnode; the record of each recovery.
- ``churn.py``        how often compnodes fail as this broker saw it; how far apart replica rounds go.
- ``replicas.py``     the books of failover snapshots kept on compnodes (``ReplicaBook``, ring holders).
- ``step_rows.py``    the metrics rows a checkpoint or replica pointer carries, in an append-only file.
- ``checkpoints.py``  a job's durable state: its submission and the latest step-boundary checkpoint.
- ``tensorfiles.py``  tensors by key in safetensors files, read when asked for (the broker never
                      holds a whole model in memory).
- ``links.py``        probing a placement's links; the answers go into ``planning.links.LinkBook``.
- ``store.py``        persistent state in SQLite under the state dir.
- ``deployments.py``  the ``deploy`` / ``undeploy`` / ``deployments`` RPCs and the HTTP API's lookup.
- ``deployment_windows.py``  a deployed causal LM's context window, vocabulary and end-of-text ids.
- ``deployment_run.py``  one deployment: a resident ``infer`` placement whose steps are request batches.
- ``serve_links.py``  a deployment's batches straight to its compnodes' sandbox workers over the data
                      path, answered on it; the RPC as the fallback, batch by batch.
"""
