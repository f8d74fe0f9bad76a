"""Measuring this machine for the performance model: hardware profile, micro-benchmarks, calibration.

Everything here runs torch and times it; what it measures is plain data for ``fusionnet.perfmodel``
(which stays pure) and is cached per machine. Used by the compnode at start-up (its announced
hardware record) and by ``fusionnet plan`` / ``fusionnet run`` (this machine as a ``DeviceSpec``).

Map of the package:

- ``hardware.py``            peak FLOP/s, lambda_p and memory bandwidth from timed matmuls and copies;
                             ``cached_measurement``, the one JSON cache every measurement here uses.
- ``microbench.py``          micro-benchmarks of the fixed costs per op class, per sub-DAG call and per
                             optimizer tensor, and of each class's efficiency.
- ``calibration.py``         the fixed costs refitted to synthetic models run through the real executor;
                             ``local_device_spec`` (this machine as a ``DeviceSpec``).
- ``calibration_models.py``  the synthetic models the calibration runs.
- ``node.py``                a compnode's ``HardwareInfo`` record: its own profile and cache in the
                             state dir, plus the measured overheads it announces.
"""
