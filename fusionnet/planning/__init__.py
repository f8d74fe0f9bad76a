"""The planner: problem (2)'s scheduler, placement policy, link and speed books, predictions.

Pure functions of data. It imports the IR (``fusionnet.dag``), the job's optimizer settings
(``fusionnet.job.optim``), the performance model and the errors, and nothing of the daemons, the
commands or hivemind (the import contract in pyproject.toml keeps it so): the broker calls it, and so
do ``fusionnet plan``, ``fusionnet run --local`` and the benchmarks.

Map of the package:

- ``costgraph.py``         IR graph -> the performance model's ``CostGraph`` (placeholders and
                           variables folded into their users), and a plan back onto IR nodes.
- ``optimizers.py``        torch.optim settings -> the performance model's optimizer profile names.
- ``planner.py``           ``plan_graph``: IR + devices + links -> sub-DAG assignment, devices, prediction;
                           ``plan_interleaved``: the even cut of an interleaved-1f1b job, priced.
- ``predict.py``           predictions for a partition already chosen (``run --local``, the broker).
- ``pipeline_schedule.py`` ``placement.schedule``: a named schedule checked on the cut, or ``auto``.
- ``auto_interleaved.py``  ``auto`` weighing interleaved-1f1b (p x v even chunks) against that choice.
- ``placement.py``         which compnodes run a job: first placement, failover, hand-over, growth.
- ``placement_types.py``   what placement works on and answers: candidates, the job's shape, a placement.
- ``cut_plan.py``          a job's own cuts (``placement.cuts``) on devices: each piece's device, priced.
- ``links.py``             ``LinkBook``: measured alpha-beta links per compnode pair, blended over jobs.
- ``speeds.py``            ``SpeedBook``: per-compnode slowness refined from measured step times.
- ``misprediction.py``     ``PredictionWatch``: when measured step times contradict the prediction enough
                           to look at the placement again.
- ``scheduler.py``         ``schedule``: the search over device orders and cuts (entry point).
- ``scheduler_linear.py``  topological orders of the DAG and the prefix sums the DPs cut.
- ``scheduler_dp.py``      segment DPs: one order cut into stages, a device per stage (``class_dp``).
- ``scheduler_refine.py``  local search over single-op moves, priced by ``evaluate_assignment``.
- ``scheduler_exact.py``   the exact solver for small instances (quality benchmark and tests).
- ``scheduler_plan.py``    ``Plan``: a schedule as data, with its text and JSON forms.
"""
