"""Who may submit jobs to this broker, how much each submitter may ask for, and who may see a job.

Every submission is signed by its submitter's key (``messages.auth``); the broker then decides:

- ``--submitters FILE``: only the submitter ids listed (one hex public key a line, as ``fusionnet key``
  prints it; ``#`` comments). The file is read again when it changes, so adding a user needs no restart.
- ``--open-submissions``: any key may submit (a choice the broker logs as a warning at start-up).
- neither: open when the broker listens on loopback only (a swarm on one machine: the demo, tests),
  closed otherwise, so that a broker reachable from a network never takes work from strangers by
  default. Both choices are logged.

Per-submitter quotas (``--max-jobs-per-submitter``, ``--max-steps``, ``--max-graph-nodes``,
``--max-submission-mb``) bound what one key can take of the swarm; a refusal names the limit and the flag.
A submitter's live jobs and deployments count against ``--max-jobs-per-submitter`` together, each from the
moment its admission passed the check (a ``Hold``, taken with no await between check and count, so that
concurrent admissions see each other) until it fails or ends.
A job's status details, its results and its cancellation are for its submitter only (``check_owner``).
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fusionnet.errors import JobError
from fusionnet.messages.auth import SubmitterAuth, verify_auth

log = logging.getLogger("fusionnet.broker.admission")

_HEX = set("0123456789abcdef")


@dataclass
class AdmissionConfig:
    submitters_file: Path | None = None  # allowlist of submitter ids
    open_submissions: bool = False  # any key may submit (explicit)
    max_jobs_per_submitter: int = 4  # QUEUED/PLANNING/RUNNING at once
    max_steps: int = 100_000  # per job
    max_graph_nodes: int = 20_000  # IR nodes per job
    max_submission_bytes: int = 1 << 30  # IR + state + data of one job

    def __post_init__(self) -> None:
        if self.submitters_file is not None and self.open_submissions:
            raise ValueError("--submitters and --open-submissions exclude each other")
        if self.submitters_file is not None:
            self.submitters_file = Path(self.submitters_file)
            read_submitters(self.submitters_file)  # a bad file fails before anything starts
        for flag, value in (
            ("--max-jobs-per-submitter", self.max_jobs_per_submitter),
            ("--max-steps", self.max_steps),
            ("--max-graph-nodes", self.max_graph_nodes),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.max_submission_bytes < 1:
            mb = self.max_submission_bytes / 2**20
            raise ValueError(f"--max-submission-mb must be more than 0, got {mb:g}")


def read_submitters(path: Path) -> frozenset[str]:
    """The submitter ids of an allowlist file; ``ValueError`` naming the line of anything else."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--submitters {path}: cannot read it ({e})") from e
    ids = set()
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip().lower()
        if not text:
            continue
        if len(text) != 64 or not set(text) <= _HEX:
            raise ValueError(
                f"--submitters {path}:{number}: not a submitter id (64 hex digits): {text[:80]!r}"
            )
        ids.add(text)
    return frozenset(ids)


def loopback_only(host_maddrs: Sequence[str]) -> bool:
    """Whether every listen multiaddr is a loopback address (nobody else can reach the broker)."""
    for maddr in host_maddrs:
        parts = maddr.split("/")
        if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
            return False
        try:
            if not ipaddress.ip_address(parts[2]).is_loopback:
                return False
        except ValueError:
            return False
    return bool(host_maddrs)


class Hold:
    """One live job or deployment of a submitter, counted by its ``Admission`` until ``release``."""

    def __init__(self, live: Counter[str], submitter: str) -> None:
        self._live: Counter[str] | None = live
        self.submitter = submitter
        live[submitter] += 1

    def release(self) -> None:
        """Gives the place back; again is a no-op (a failed admission and its ended task may both call)."""
        if self._live is None:
            return
        self._live[self.submitter] -= 1
        if self._live[self.submitter] <= 0:
            del self._live[self.submitter]
        self._live = None


@dataclass
class Admission:
    """The broker's submission policy, built once at start-up."""

    config: AdmissionConfig
    open: bool
    _allowed: frozenset[str] = frozenset()
    _mtime: float = field(default=-1.0)
    # submitter -> its jobs and deployments live or being admitted (the ``Hold``s not released)
    _live: Counter[str] = field(default_factory=Counter)

    @classmethod
    def create(cls, config: AdmissionConfig, host_maddrs: Sequence[str]) -> Admission:
        if config.submitters_file is not None:
            policy = cls(config, open=False)
            policy._reload()
            log.info(
                "submissions: only the %d submitter(s) in %s", len(policy._allowed), config.submitters_file
            )
        elif config.open_submissions:
            policy = cls(config, open=True)
            log.warning("submissions: OPEN to any key (--open-submissions); quotas apply per key")
        elif loopback_only(host_maddrs):
            policy = cls(config, open=True)
            log.info(
                "submissions: open to any key (the broker listens on loopback only; "
                "--submitters FILE restricts them)"
            )
        else:
            policy = cls(config, open=False)
            log.warning(
                "submissions: CLOSED (the broker is reachable from the network and neither --submitters "
                "FILE nor --open-submissions is given): every submission will be refused"
            )
        return policy

    def _reload(self) -> None:
        path = self.config.submitters_file
        assert path is not None
        try:
            mtime = path.stat().st_mtime
        except OSError as e:
            raise JobError(f"the broker's --submitters file is unreadable ({e}); refusing submissions") from e
        if mtime != self._mtime:
            try:
                self._allowed = read_submitters(path)
            except ValueError as e:
                raise JobError(f"the broker's submitter list is broken ({e}); refusing submissions") from e
            self._mtime = mtime

    def authorise_submit(self, auth: SubmitterAuth | None, *, broker: str, caller: str, digest: str) -> str:
        """The submitter id of a properly signed submission this broker accepts, else ``JobError``."""
        return self.authorise(auth, broker=broker, caller=caller, scope="submit_job", subject=digest)

    def authorise(
        self, auth: SubmitterAuth | None, *, broker: str, caller: str, scope: str, subject: str
    ) -> str:
        """The submitter id of a call signed for ``scope``/``subject`` by a submitter this broker takes work
        from (a submission, or the state upload before it), else ``JobError``."""
        submitter = verify_auth(auth, broker=broker, caller=caller, scope=scope, subject=subject)
        if self.open:
            return submitter
        if self.config.submitters_file is not None:
            self._reload()
            if submitter in self._allowed:
                return submitter
            raise JobError(
                f"submitter {submitter} may not submit to this broker (not in its --submitters list); "
                "send the operator the id `fusionnet key` prints"
            )
        raise JobError(
            "this broker takes no submissions (its operator set neither --submitters nor --open-submissions)"
        )

    def live(self, submitter: str) -> int:
        """The submitter's jobs and deployments that hold a place now (admitted, or being admitted)."""
        return self._live[submitter]

    def hold(self, submitter: str, *, check: bool = True) -> Hold:
        """A place among the submitter's live jobs and deployments, refused over
        ``--max-jobs-per-submitter``. Counted at once: an admission awaits a lot after its check (hashing,
        decoding, writing the state), and a count of launched work only would let concurrent ones all pass.
        ``check=False``: counted, never refused (a job resumed after a restart was admitted before)."""
        if check:
            self.check_quota(submitter, running=self._live[submitter], steps=0, nodes=0, nbytes=0)
        return Hold(self._live, submitter)

    def check_size(self, nbytes: int) -> None:
        """Refuses a submission (a job's or a deployment's) over ``--max-submission-mb``: checked before its
        signature is verified, since that hashes all of it (seconds at gigabytes)."""
        limit = self.config.max_submission_bytes
        if nbytes > limit:
            raise JobError(
                f"submission refused: {nbytes} submission bytes exceed this broker's limit of {limit} "
                "(--max-submission-mb)"
            )

    def check_quota(self, submitter: str, *, running: int, steps: int, nodes: int, nbytes: int) -> None:
        """Refuses a job over one of the per-submitter limits, naming the limit and its flag."""
        c = self.config
        for what, value, limit, flag in (
            (
                "jobs and deployments of this submitter live",
                running + 1,
                c.max_jobs_per_submitter,
                "--max-jobs-per-submitter",
            ),
            ("steps", steps, c.max_steps, "--max-steps"),
            ("IR nodes", nodes, c.max_graph_nodes, "--max-graph-nodes"),
            ("submission bytes", nbytes, c.max_submission_bytes, "--max-submission-mb"),
        ):
            if value > limit:
                log.warning("submission from %s refused: %d %s > %d", submitter[:16], value, what, limit)
                raise JobError(
                    f"submission refused: {value} {what} exceeds this broker's limit of {limit} ({flag})"
                )


def check_owner(
    row_submitter: str | None,
    auth: SubmitterAuth | None,
    *,
    broker: str,
    caller: str,
    scope: str,
    job_id: str,
) -> str:
    """The caller's submitter id when it is the job's submitter; a ``JobError`` otherwise. The error
    reads the same as for an unknown job, so a stranger learns nothing about the job."""
    try:
        who = verify_auth(auth, broker=broker, caller=caller, scope=scope, subject=job_id)
    except JobError as e:
        raise JobError(f"{e} (job {job_id})") from None
    if not row_submitter or who != row_submitter:
        log.info("%s of job %s refused: %s is not its submitter", scope, job_id, who[:16])
        raise JobError(f"no job {job_id!r} submitted with this key")
    return who
