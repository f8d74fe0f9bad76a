"""What every FusionNet daemon shares: lifecycle, swarm presence, files, logs (metrics: fusionnet.metrics).

Map of the package:

- ``base.py``      ``Daemon``: ``serve()`` = startup -> main loop -> graceful shutdown; signals (second one
                   forces exit), owned background tasks (``spawn``/``every``), ``Service`` plug-ins.
- ``config.py``    ``DaemonConfig``, validated; built from the parsed flags (``common_config``).
- ``flags.py``     the command-line flags all daemons share (light: no hivemind import).
- ``swarm.py``     ``SwarmPeer``: DHT child + p2pd handle + RPC server/client + announcer, started and
                   stopped together.
- ``observer.py``  ``SwarmObserver``: a DHT client that reads records and asks the broker for its status.
- ``files.py``     the locked state dir and the atomically written address file (the readiness signal).
- ``logs.py``      ``[role peer_id]`` on every log line.
- ``addresses.py`` which multiaddrs are worth publishing (no loopback into a swarm across machines) and
                   where a compnode's data path listens and what it announces (``--data-host`` default).
- ``memory.py``    glibc's allocator: daemons return large freed buffers, sandbox workers keep theirs.
"""
