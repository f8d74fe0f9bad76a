"""Driving jobs end to end, shared by the commands.

Map:
- ``prepare.py``  job -> traced IR + initial state + partition (what ``plan``, ``run`` and ``submit`` share)
- ``batches.py``  the data a step feeds to each sub-DAG, micro-batch by micro-batch
- ``local.py``    ``fusionnet run --local N``: N executors in one process over the in-memory channel
  (results assembled and written by ``fusionnet.results``, as the broker does)
"""
