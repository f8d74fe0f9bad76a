"""Driving jobs end to end, shared by the commands.

Map:
- ``prepare.py``  job -> traced IR + initial state + partition (what ``plan``, ``run`` and ``submit`` share)
- ``batches.py``  the data a step feeds to each sub-DAG, micro-batch by micro-batch
- ``local.py``    ``fusionnet run --local N``: ``InMemorySwarm``, N executors in one process over the
                  in-memory channel
- ``process_swarm.py`` ``ProcessSwarm``: a broker and compnodes as real processes on loopback
                  (``fusionnet demo``, benchmarks, tests); ``BlockingObserver`` reads it from sync code
- ``processes.py`` one daemon as a child process (``DaemonProcess``, ``start_daemon``), process-tree helpers
- ``results.py``  the result files of interface.md (weights, grads, outputs, metrics.jsonl, plan.json)
"""
