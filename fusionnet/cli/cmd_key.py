"""``fusionnet key [--key FILE]``: print this user's submitter id (made on first use).

The id is what a broker operator puts in the broker's ``--submitters`` file to let this user submit;
the key itself never leaves this machine (``fusionnet.runtime.submitter``).
"""

from __future__ import annotations

import argparse
from typing import Any

from fusionnet.cli.jobflags import add_key_flag


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "key",
        help="print your submitter id (for a broker's --submitters list)",
        description="Prints the submitter id (hex Ed25519 public key) that submit, status, cancel and "
        "results sign with, making the key on first use (0600, in a 0700 folder). Give the id to a broker "
        "operator to be let in with --submitters.",
    )
    add_key_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.runtime.submitter import Signer, load_or_create_key

    # None: the default key (the loader's errors then name $FUSIONNET_KEY or the default, not --key)
    print(Signer(load_or_create_key(args.key), "", "").submitter_id)
    return 0
