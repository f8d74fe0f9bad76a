"""The ``fusionnet`` console script.

Map:
- ``main.py``          argument parsing and dispatch; each sub-command lives in its own module
- ``cmd_<name>.py``    one sub-command each, exposing ``add_parser(subparsers)`` and ``run(args) -> int``
  (``COMMANDS``: demo, broker, compnode, submit, cancel, results, deploy, run, plan, status, section4, key):
  ``cmd_demo.py``, ``cmd_broker.py``, ``cmd_compnode.py``, ``cmd_submit.py``, ``cmd_cancel.py``,
  ``cmd_results.py``, ``cmd_deploy.py`` (``deploy`` and ``undeploy``), ``cmd_run.py``, ``cmd_plan.py``,
  ``cmd_status.py``, ``cmd_section4.py``, ``cmd_key.py``
- ``argtypes.py``      argument types the commands share (``--initial-peers``, seconds), refused by argparse
- ``jobflags.py``      the job-loading flags of plan/run/submit, ``--key``, the ``--output`` and ``JOB_ID``
                       checks
"""
