"""The compnode daemon: announces its hardware, runs the sub-DAGs it is assigned, exchanges tensors.

Measuring the hardware is ``fusionnet.profiling.node``'s job; the daemon only announces the result.

Map of the package:

- ``daemon.py``      ``Compnode``: DHT join, start-up profiling, hardware record, RPC services, shutdown.
- ``tasks.py``       the service behind the broker's ``assign``: holding jobs, their RPCs, hand-over.
- ``assign_rpc.py``  its ``assign`` and ``stage_state`` calls: building and holding a job (a mixin).
- ``step_rpc.py``    its ``step`` and ``serve_step`` calls (a mixin).
- ``serve_steps.py`` a deployment's batches through a resident sub-DAG (inference and generation).
- ``staging.py``     a slice's state sent ahead of its ``assign``, held until the assignment names it.
- ``replicas.py``    failover snapshots: packed in chunks, kept on disk, sent to the holder in step order.
- ``replica_rpc.py`` the ``replicate`` / ``replicas`` / ``fetch_replica`` calls (a mixin).
- ``replica_frames.py``  snapshot chunks as frames over the direct data path, and their confirmation.
- ``snapshots.py``   a snapshot's copy beside the next step on CUDA (side stream), gated before Update.
- ``valuepack.py``   small values packed into one frame (tensors and their structure).
- ``assignment_intake.py``  one job's sub-DAG here, from a validated ``assign``: checked IR, rebuilt
                     executor, network channel, data.
- ``job_host.py``    what the service does with a built sub-DAG (steps, batches, collect, snapshots),
                     in-process or in its sandbox worker; ``HeldJob``, the daemon's record of it.
- ``device_step.py`` a compnode holding several sub-DAGs of a job (interleaved-1f1b's chunks): one
                     step of all of them in its program's order, answered per sub-DAG.
- ``sandbox_pool.py``    where the sandbox workers come from: the fork server, a worker per assignment.
- ``sandbox_client.py``  the daemon's side of a job's sandbox worker: calls, values, worker death.
- ``sandbox_worker.py``  a job's worker process: builds and runs the sub-DAG under a memory budget.
- ``worker_process.py`` a worker process's settings and limits (config, death with its parent, memory).
- ``sandbox_ipc.py`` the messages between daemon and worker (msgpack + raw tensor bytes, bounded).
- ``sandbox_preload.py``  what the fork server imports, at a lower CPU priority.
- ``worker_sends.py``  a sandbox worker's values to its peers, sent by the worker over the direct data path.
- ``worker_serves.py``  a deployment's batches at its sandbox worker, straight from the broker over the
                     data path, answered on the connection they came on.
- ``tcp_down.py``    peers whose direct data path failed, shared by the daemon and its workers, retried later.
- ``worker_receives.py``  a sandbox worker's values from its peers, read by the worker from the
                     connections its daemon hands over (``wire.handoff``).
- ``trust.py``       which brokers a compnode obeys; assignments whose broker went silent (or whose
                     broker's heartbeat no longer lists them) end.
- ``compute.py``     the compute thread: FP/BP/Update (and state packing) off the event loop.
- ``netchannel.py``  the executor's ``Channel`` over the network (authenticated tensor frames).
- ``value_frames.py`` what a value frame carries: its route, the value's structure, the check against the IR.
- ``linkprobe.py``   timing the links to the job's other compnodes (alpha + beta * M).
- ``throttle.py``    an emulated slow device (``--slowdown F``) for heterogeneous swarms on one host.
- ``faults.py``      fault injection for recovery tests and benchmarks.
"""
