"""Prometheus metrics of the FusionNet daemons, their HTTP endpoint and compnode service discovery.

Map of the package:

- ``common.py``   label vocabularies, bucket layouts, build info, helpers shared by both sets.
- ``broker.py``   ``BrokerMetrics``; ``BROKER_METRICS`` / ``BROKER_REGISTRY`` and its module-level objects.
- ``compnode.py`` ``CompnodeMetrics``; ``COMPNODE_METRICS`` / ``COMPNODE_REGISTRY`` and its objects.
- ``workers.py``  ``WorkerProcesses``: the sandbox workers' CPU and memory, read from ``/proc``.
- ``serving.py``  ``ServingMetrics`` (``BrokerMetrics.serving``): requests, tokens, latencies, batches, queue.
- ``server.py``   ``start_metrics_server(registry, port, host) -> (host, port)`` and ``stop_metrics_server``.
- ``sd.py``       ``file_sd_targets``, ``write_file_sd`` (atomic) and ``http_sd_app`` (``/sd/compnodes``).

Each daemon exports its own registry (never the process-global default), so an in-process test swarm
keeps its daemons' numbers apart by giving each a fresh ``BrokerMetrics()`` / ``CompnodeMetrics()``.

Both daemons
    fusionnet_build_info{version,daemon,python,torch,hivemind} 1; the build (daemon: broker|compnode)
    fusionnet_node_info{peer_id}                 1; this daemon's libp2p peer id (one series per daemon)
    fusionnet_start_time_seconds                 Unix time the daemon became ready
    process_*                                    CPU seconds, resident memory, open fds of the process

Broker (``BROKER_REGISTRY``)
    fusionnet_swarm_compnodes{role,state}        by state: joining|online|draining|offline|unreachable
    fusionnet_backup_pool_compnodes              online backup compnodes free for failover
    fusionnet_jobs{state}                        state: queued|planning|running|succeeded|failed|cancelled
    fusionnet_jobs_submitted_total               jobs accepted
    fusionnet_steps_total                        steps completed, all jobs
    fusionnet_samples_total                      samples processed, all jobs
    fusionnet_step_duration_seconds              histogram: wall time of one step (FP + BP + Update)
    fusionnet_step_prediction_error_ratio        histogram: |measured / predicted step time - 1|
    fusionnet_subtask_prediction_error_ratio     histogram: |measured / predicted sub-DAG compute - 1|
    fusionnet_job_loss{job_id}                   latest loss            } running jobs only: removed by
    fusionnet_job_step{job_id}                   latest step index      } ``forget_job`` when the job
    fusionnet_job_last_step_timestamp_seconds{job_id}  when it moved  } ends, so job_id stays bounded
    fusionnet_job_samples_per_second{job_id}     throughput of the latest step
    fusionnet_job_prediction_error_ratio{job_id} signed measured / predicted - 1 of the latest step
    fusionnet_job_step_beyond_compute_ratio{job_id}  share of the latest step beyond its compute path
    fusionnet_job_compnodes{job_id}              compnodes running the job
    fusionnet_heartbeat_rtt_seconds              histogram: broker -> compnode ping round trip
    fusionnet_heartbeat_failures_total           pings lost or timed out
    fusionnet_failovers_total                    compnodes replaced in running jobs
    fusionnet_recovery_phase_duration_seconds{phase}  histogram; phase: detection|redistribution|replay

Compnode (``COMPNODE_REGISTRY``)
    fusionnet_compnode_state{state}              1 for the current state (same vocabulary as above)
    fusionnet_compnode_load                      announced load, 0..1
    fusionnet_compnode_running_subtasks          sub-tasks held now
    fusionnet_compnode_subtasks_total{outcome}   finished sub-tasks; outcome: succeeded|failed|cancelled
    fusionnet_compnode_speed_factor              fitted lambda_p = measured / peak FLOPS (FusionAI 3.7)
    fusionnet_compnode_peak_flops                nominal peak S*(p), FLOP/s
    fusionnet_compnode_activation_peak_bytes     most activation bytes held at once in the last train step
    fusionnet_compute_duration_seconds{phase}    histogram per step; phase: forward|backward|update
    fusionnet_data_bytes_total{path,direction}   tensor bytes; path: tcp|p2p, direction: sent|received
    fusionnet_data_frames_total{path,direction}  tensor frames, same labels
    fusionnet_frames_refused_total{reason}       refused frames; reason: ``wire.refusal.REASONS``
    fusionnet_sandbox_workers                    sandbox worker processes running now
    fusionnet_sandbox_cpu_seconds_total          their CPU (user + system), ended workers included
    fusionnet_sandbox_resident_memory_bytes      resident memory of the live ones

Scrape targets carry ``role``, ``backup`` and ``peer`` labels from service discovery (``sd.py``), so no
compnode metric may have a label of those names (Prometheus would rename it ``exported_<name>``); the
broker's target carries none, since its own series use ``role``.
"""

from fusionnet.metrics.broker import BROKER_METRICS, BROKER_REGISTRY, BrokerMetrics
from fusionnet.metrics.common import exposed_names, referenced_metrics
from fusionnet.metrics.compnode import COMPNODE_METRICS, COMPNODE_REGISTRY, CompnodeMetrics
from fusionnet.metrics.sd import SD_PATH, ScrapeTarget, file_sd_targets, http_sd_app, write_file_sd
from fusionnet.metrics.server import MetricsEndpoint, metrics_app, start_metrics_server, stop_metrics_server

__all__ = [
    "BROKER_METRICS",
    "BROKER_REGISTRY",
    "COMPNODE_METRICS",
    "COMPNODE_REGISTRY",
    "SD_PATH",
    "BrokerMetrics",
    "CompnodeMetrics",
    "MetricsEndpoint",
    "ScrapeTarget",
    "exposed_names",
    "file_sd_targets",
    "http_sd_app",
    "metrics_app",
    "referenced_metrics",
    "start_metrics_server",
    "stop_metrics_server",
    "write_file_sd",
]
