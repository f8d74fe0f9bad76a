"""FusionNet: a decentralized peer-to-peer compute network for training and serving neural networks.

Map of the package (one job per sub-package):

- ``dag``       IR plane and execution plane: tracing, op registry, IR codec, partitioning,
                sub-DAG rebuild and the FP/BP/Update executor.
- ``job``       job-file schema, validation and loading (model, data, weights).
- ``perfmodel`` PALEO-style performance model: pure functions of data.
- ``planning``  the scheduler for problem (2), placement, link and speed books, predictions (pure).
- ``profiling`` measuring this machine: hardware profile, micro-benchmarks, executor calibration.
- ``metrics``   Prometheus metrics of the daemons.
- ``broker``    broker daemon: intake, registry, placement (by ``planning``), supervision.
- ``compnode``  compnode daemon.
- ``daemon``    what both daemons share: lifecycle, config, flags, DHT observer.
- ``dht``       record schemas and announce/lookup over hivemind's DHT.
- ``rpc``       typed RPC over hivemind P2P.
- ``wire``      tensor frames and the authenticated direct data path between compnodes.
- ``runtime``   driving jobs from the submitter's machine (plan, run --local, submit).
- ``cli``       the ``fusionnet`` console script.

Layers, top to bottom (an import never runs up; ``[tool.importlinter]`` in pyproject.toml checks it):
cli -> runtime -> broker | compnode -> daemon -> profiling -> planning -> perfmodel | metrics ->
wire | rpc | dht | job | dag -> errors.
"""

__version__ = "0.1.0"
