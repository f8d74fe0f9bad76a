"""Seeded, time-bounded fuzzing of every decoder a peer's bytes reach (issue 12, deliver 5).

- ``harness.py``            the mutation engine and the run loop (no FusionNet imports).
- ``targets.py``            one target per decoder: seeds, and the errors that count as a refusal.
- ``rpc_targets.py``        RPC envelopes (requests, replies) and every typed message model.
- ``test_fuzz_decoders.py`` runs each target for ``FUSIONNET_FUZZ_SECONDS`` (default 3 s each).
- ``corpus/<target>/``      inputs kept in the repo: every run starts from them as extra seeds;
                            an input that crashed a decoder is written there (``FUSIONNET_FUZZ_SAVE=1``).
"""
