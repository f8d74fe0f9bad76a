"""The security suite (issue 12): the attacks of the review replayed against a real loopback swarm
(``test_attacks.py``, marked ``swarm``)."""
