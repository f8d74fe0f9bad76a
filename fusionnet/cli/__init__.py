"""The ``fusionnet`` console script.

Map:
- ``main.py``          argument parsing and dispatch; each sub-command lives in its own module
- ``cmd_<name>.py``    one sub-command each, exposing ``add_parser(subparsers)`` and ``run(args) -> int``
"""
