"""Driving jobs end to end from the submitter's machine, shared by the commands.

Map of the package:

- ``prepare.py``     job -> traced IR + initial state + partition (what ``plan``, ``run`` and ``submit``
                     share).
- ``loss_reduction.py`` how a job's loss combines over micro-batches, and the loss its graph computes.
- ``planjob.py``     ``fusionnet plan``: the job traced and planned (``fusionnet.planning``) for a nodes
                     file or for compnodes like this machine (``fusionnet.profiling``).
- ``batches.py``     the data a step feeds to each sub-DAG, micro-batch by micro-batch.
- ``local.py``       ``fusionnet run --local N``: ``InMemorySwarm``, N executors in one process over the
                     in-memory channel (results assembled and written by ``fusionnet.results``, as the
                     broker does).
- ``submit.py``      ``fusionnet submit``: send the IR, state and data to a broker, follow, download;
                     cancel the job on Ctrl-C or --timeout.
- ``loadcheck.py``   the job loaded once in a bounded child process first (model code cannot hang or end the
                     command).
- ``microbatch_sizes.py`` which micro-batch sizes a job runs, whether its traced graph runs them, what
                     ``data.microbatches: auto`` may choose.
- ``deploy.py``      ``fusionnet deploy`` / ``undeploy``: trace here, send as a deployment, wait for its
                     placement; or release one.
- ``submitter.py``   the submitter's key (made on first use, 0600) and ``Signer`` for its calls.
- ``jobcontrol.py``  waiting for the compnodes a job needs, ``cancel_job``, downloading kept results
                     (``submit``, ``fusionnet cancel``, ``fusionnet results``).
- ``process_swarm.py`` ``ProcessSwarm``: a broker and compnodes as real processes on loopback
                     (``fusionnet demo``, benchmarks, tests); ``BlockingObserver`` reads it from sync code.
- ``netns.py``       ``NetLab``: hosts as network namespaces on a bridge, links shaped with tbf (the
                     multi-host tests and ``benchmarks/links.py``; needs root).
- ``netns_swarm.py`` ``NetnsSwarm``: a broker and compnodes in those namespaces, started with the README's
                     flags.
- ``processes.py``   one daemon as a child process (``DaemonProcess``, ``start_daemon``), process-tree
                     helpers.

The tensor blobs and the run spec that travel with a job live below this layer, in
``fusionnet.messages.blobs`` and ``fusionnet.messages.jobwire``.
"""
