"""What peers say to each other: typed RPC requests and replies, and the job records they carry.

A layer of its own under the daemons (broker, compnode) and the client runtime, over ``rpc``, ``dht``,
``job`` and ``dag``: both ends of a call import the same models, so the contract is written once.

Map of the package:

- ``base.py``          ``Message`` (unknown fields ignored, known ones strict), ``parse_message`` (one
                       ``WireError`` naming the method and the field), ``@handles`` for ``rpc_<name>``
                       handlers that take and return models, ``TypedCaller`` for the clients.
- ``broker_rpc.py``    the broker's methods (ping, status, submit_job, job_status, job_results,
                       leaving) and ``BrokerClient``.
- ``compnode_rpc.py``  a compnode's methods (ping, info, assign, step, collect, release, probe_links)
                       and ``CompnodeClient``.
- ``serving_rpc.py``   deployments: the broker's ``deploy`` / ``undeploy`` / ``deployments``, the compnode's
                       ``serve_step``, and ``ServingClient``.
- ``serve_frames.py`` a batch's ``serve_step`` and its answer as frames on the direct data path (issue 14).
- ``auth.py``          ``SubmitterAuth``: a submitter's Ed25519 signature bound to broker, caller, method
                      and subject; the submission digest.
- ``jobwire.py``       ``RunSpec``: the job-file settings the execution plane needs, as sent.
- ``blobs.py``         tensors <-> safetensors bytes, never pickle.
"""
