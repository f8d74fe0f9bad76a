"""FusionNet: a decentralized peer-to-peer compute network for training and serving neural networks.

Map of the package (one job per sub-package):

- ``dag``       IR plane and execution plane: tracing, op registry, IR codec, partitioning,
                sub-DAG rebuild and the FP/BP/Update executor.
- ``job``       job-file schema, validation and loading (model, data, weights).
- ``perfmodel`` PALEO-style performance model: pure functions of data.
- ``broker``    broker daemon and the scheduler for problem (2).
- ``compnode``  compnode daemon.
- ``dht``       record schemas and announce/lookup over hivemind's DHT.
- ``wire``      tensor frames and the authenticated direct data path between compnodes.
- ``cli``       the ``fusionnet`` console script.
"""

__version__ = "0.1.0"
