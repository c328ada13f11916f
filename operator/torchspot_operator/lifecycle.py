"""The job's lifecycle: the clocks its rules count from, the backoff after worker failures, when
it finishes (success, or which failure rule), and its phase and conditions. Pure.

Written down for users in docs/operator.md ("Lifecycle"). Conditions follow the training
operator's and JobSet's rules (conditions.py): one typed constant per condition, a
Reason/Message pair, and `lastTransitionTime` moved only when the status flips.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from torchspot_operator import conditions, constants, verdicts
from torchspot_operator.spec import JobSpec


@dataclass
class Clocks:
    """The times the lifecycle's rules count from (each is in the status; None: not running).

    - `start`: when the current active period began (creation, or the last resume);
      activeDeadlineSeconds and the start-up timeout count from it;
    - `reached_min`: the first time in this period the job had minReplicas ready; until
      then it is Pending and WaitingForCapacity;
    - `below_since`: when ready workers last fell below minReplicas after reaching it;
      the below-minimum grace counts from it.
    """

    start: str | None
    reached_min: str | None
    below_since: str | None
    completion: str | None
    now: datetime

    @classmethod
    def read(cls, old: Mapping[str, Any], now: datetime, spec: JobSpec, *, suspended: bool, resumed: bool) -> Clocks:
        if suspended:
            return cls(None, None, None, None, now)
        if resumed:
            return cls(conditions.timestamp(now), None, None, None, now)
        return cls(
            old.get("startTime") or conditions.timestamp(now),
            old.get("reachedMinAt"),
            old.get("belowMinSince"),
            None,
            now,
        )

    def observe(self, ready: int, minimum: int) -> None:
        if self.start is None:
            return
        if ready >= minimum:
            self.reached_min = self.reached_min or conditions.timestamp(self.now)
            self.below_since = None
        elif self.reached_min is not None and self.below_since is None:
            self.below_since = conditions.timestamp(self.now)

    def since(self, stamp: str | None) -> float:
        return 0.0 if stamp is None else (self.now - conditions.parse_timestamp(stamp)).total_seconds()

    def record(self) -> dict[str, Any]:
        return {
            "startTime": self.start,
            "reachedMinAt": self.reached_min,
            "belowMinSince": self.below_since,
            "completionTime": self.completion,
        }


@dataclass
class Backoff:
    """Replacements held back after consecutive worker failures (`status.backoff`)."""

    streak: int
    until: datetime | None
    replacements: int
    released: int = 0
    """Replacements whose wait ended in this reconcile: they are created now, as replacements."""

    @classmethod
    def read(cls, old: Mapping[str, Any], now: datetime) -> Backoff:
        """The backoff in the status; a streak with nothing held is forgotten `BACKOFF_RESET_SECONDS` after
        the last failure."""
        raw = old.get("backoff") or {}
        until = conditions.parse_timestamp(raw["until"]) if raw.get("until") else None
        held = int(raw.get("replacements", 0))
        last = (old.get("lastFailure") or {}).get("time")
        if not held and (
            last is None or (now - conditions.parse_timestamp(last)).total_seconds() >= constants.BACKOFF_RESET_SECONDS
        ):
            return cls(0, None, 0)
        return cls(int(raw.get("consecutiveFailures", 0)), until, held)

    def failed(self, count: int, *, previous: Mapping[str, Any] | None, now: datetime) -> None:
        """`count` new failures: the streak grows (or starts again after a quiet while) and so does the wait."""
        last = conditions.parse_timestamp(previous["time"]) if previous and previous.get("time") else None
        quiet = last is None or (now - last).total_seconds() >= constants.BACKOFF_RESET_SECONDS
        self.streak = (0 if quiet else self.streak) + count
        delay = min(constants.BACKOFF_BASE_SECONDS * 2 ** (self.streak - 1), constants.BACKOFF_CAP_SECONDS)
        self.until = conditions.not_before(now + timedelta(seconds=delay))  # read back from the status
        self.replacements += count

    def hold(self, now: datetime) -> int:
        """How many replacements wait now; those whose wait is over are released."""
        if self.replacements and self.until is not None and now < self.until:
            return self.replacements
        self.released, self.replacements = self.replacements, 0
        return 0

    def keep(self, held: int) -> None:
        self.replacements = held

    def describe(self, now: datetime) -> str:
        wait = 0 if self.until is None else round((self.until - now).total_seconds())
        return (
            f"replacing {self.replacements} failed worker pod(s) in {wait} s "
            f"({self.streak} consecutive failure(s); evictions are replaced at once)"
        )

    def record(self) -> dict[str, Any] | None:
        if not self.streak:
            return None
        return {
            "consecutiveFailures": self.streak,
            "until": None if self.until is None else conditions.timestamp(self.until),
            "replacements": self.replacements,
        }


SUSPECT_EVICTIONS = ("TerminationByKubelet", "UnexpectedAdmissionError", "OutOf", constants.NODE_FAULT_REASON)
"""Eviction reasons that may be the job's own doing or follow it: the kubelet's node-pressure evictions
(memory the job uses), node faults at admission, and workers that found node after node unable to run
the program (a template that hides the GPUs would look so). Repeated, they exhaust the eviction budget."""


@dataclass
class EvictionBudget:
    """Evictions of the job in the current window (`status.evictionWindow`).

    Spot evictions are the cloud's and cost the job nothing but a re-formation, so they are
    replaced at once. But more of them in `EVICTION_WINDOW_SECONDS` than twice the job's desired
    workers (at least `EVICTION_BUDGET`), or `EVICTION_REPEAT` suspect ones of the same reason in
    a row, are not the cloud: replacements then wait the failure backoff, and the
    EvictionBudgetExceeded condition says why (a Job's podFailurePolicy would have counted them).
    """

    since: datetime | None
    count: int
    last_reason: str
    repeats: int
    limit: int
    now: datetime

    @classmethod
    def read(cls, old: Mapping[str, Any], now: datetime, spec: JobSpec) -> EvictionBudget:
        raw = old.get("evictionWindow") or {}
        limit = max(constants.EVICTION_BUDGET, 2 * spec.desired)
        since = conditions.parse_timestamp(raw["since"]) if raw.get("since") else None
        if since is None or (now - since).total_seconds() > constants.EVICTION_WINDOW_SECONDS:
            return cls(None, 0, "", 0, limit, now)
        return cls(
            since, int(raw.get("count", 0)), str(raw.get("lastReason", "")), int(raw.get("repeats", 0)), limit, now
        )

    def add(self, evictions: list[verdicts.Verdict]) -> None:
        """Count this reconcile's evictions into the window."""
        for verdict in evictions:
            self.since = self.since or self.now
            self.count += 1
            self.repeats = self.repeats + 1 if verdict.reason == self.last_reason else 1
            self.last_reason = verdict.reason

    def exceeded(self) -> bool:
        repeated = self.last_reason.startswith(SUSPECT_EVICTIONS) and self.repeats >= constants.EVICTION_REPEAT
        return self.since is not None and (self.count > self.limit or repeated)

    def previous(self) -> dict[str, Any] | None:
        """The window's start as a failure record: the backoff streak counts from it."""
        return None if self.since is None else {"time": conditions.timestamp(self.since)}

    def condition(self, conds: list[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
        if self.exceeded():
            message = (
                f"{self.count} evictions since {conditions.timestamp(self.since or now)} (budget {self.limit} in "
                f"{constants.EVICTION_WINDOW_SECONDS} s; last {self.last_reason} x{self.repeats}): replacements wait "
                "the failure backoff"
            )
            return conditions.set_condition(conds, conditions.EVICTION_BUDGET, True, "TooManyEvictions", message, now)
        return conditions.clear_condition(
            conds, conditions.EVICTION_BUDGET, "WithinBudget", "evictions within the budget", now
        )

    def record(self) -> dict[str, Any] | None:
        if self.since is None:
            return None
        return {
            "since": conditions.timestamp(self.since), "count": self.count,
            "lastReason": self.last_reason, "repeats": self.repeats,
        }  # fmt: skip


@dataclass
class Progress:
    """The run's last progress as the operator saw it (`status.progress`): the rendezvous round, the
    step and the checkpoint step its milestones reported, and when one of them last moved.

    A program that never reported a step (anything but the built-in trainer) is judged by what it does
    report: its rounds, its checkpoints if it reports them, and its agents' reports that its workers
    use the CPU (`activity`, the time of the newest: trainer's activity.py). Before, a healthy script
    that trained for twice `stallTimeoutSeconds` with no membership change was failed as Stalled.
    Once a step was reported, the steps judge it: a trainer whose loop spins without a step is stalled."""

    round: int | None
    step: int | None
    checkpoint: int | None
    at: str | None
    activity: int | None = None
    """The newest worker activity counted (a program that never reported a step only)."""

    @classmethod
    def read(cls, old: Mapping[str, Any], milestones: Mapping[str, Any], now: datetime, *, resumed: bool) -> Progress:
        raw = {} if resumed else (old.get("progress") or {})
        before = cls(raw.get("round"), raw.get("step"), raw.get("checkpoint"), raw.get("at"), raw.get("activity"))

        def number(name: str, key: str) -> int | None:
            value = (milestones.get(name) or {}).get(key)
            return value if isinstance(value, int) else None

        seen = (number("round", "round"), number("step", "step"), number("checkpoint", "step"))
        stepless = before.step is None and seen[1] is None
        activity = number("activity", "at") if stepless else None
        busy = activity is not None and activity != before.activity
        merged = tuple(
            new if new is not None else was
            for new, was in zip(seen, (before.round, before.step, before.checkpoint), strict=True)
        )
        if merged == (before.round, before.step, before.checkpoint) and not busy:
            return before
        return cls(merged[0], merged[1], merged[2], conditions.timestamp(now), activity if busy else before.activity)

    def record(self) -> dict[str, Any] | None:
        if self.at is None:
            return None
        record = {"round": self.round, "step": self.step, "checkpoint": self.checkpoint, "at": self.at}
        return record if self.activity is None else {**record, "activity": self.activity}


@dataclass(frozen=True)
class Stall:
    """A job with its workers and no progress: why, and whether the job fails of it now."""

    message: str
    fail: bool
    reason: str


def _overdue(spec: JobSpec, start: str, quiet_since: str, has_round: bool, now: datetime) -> tuple[bool, bool]:
    """(quiet past the stall timeout, no round past the start-up timeout): the stall rule's clocks."""

    def since(stamp: str) -> float:
        return (now - conditions.parse_timestamp(stamp)).total_seconds()

    late_start = not has_round and since(start) > spec.startup_timeout_seconds
    return since(quiet_since) > spec.stall_timeout_seconds, late_start


def quiet_from(progress_at: str | None, reached_min: str) -> str:
    """Since when a job with minReplicas ready has been quiet: its last progress, or reaching minReplicas
    if that came later (a round its workers formed before the last of them was ready is no quiet time:
    no job can train below its minimum). Pure."""
    if progress_at is None:
        return reached_min
    return max(progress_at, reached_min, key=conditions.parse_timestamp)


def quiet_too_long(old: Mapping[str, Any], spec: JobSpec, now: datetime) -> bool:
    """Whether the job, as its status says, is overdue by the stall rule (`stall`): the only time the rule
    needs to know why, so the only time the controller reads what it needs for that."""
    reached = old.get("reachedMinAt")
    if spec.suspend or not reached:
        return False
    progress = old.get("progress") or {}
    start = str(old.get("startTime") or reached)
    since = quiet_from(progress.get("at"), str(reached))
    quiet, late = _overdue(spec, start, since, progress.get("round") is not None, now)
    return quiet or late


def stall(  # noqa: PLR0917 - each input of the rule
    spec: JobSpec,
    census: verdicts.Census,
    clocks: Clocks,
    progress: Progress,
    milestones: Mapping[str, Any],
    etcd_state: str | None,
) -> Stall | None:
    """Whether the job is stalled: minReplicas ready, and no round, step or checkpoint for
    `stallTimeoutSeconds` (since minReplicas was reached, if it never reported one).

    The cause, likeliest first: the operator reads the job's etcd, so it serves, and the run does
    not move (or never formed a round: the workers do not join); the etcd is not serving (its pod's
    waiting reason: an image pull refused by an egress firewall...); or the operator cannot read
    it (a NetworkPolicy, DNS) and cannot tell. The job fails when the cause is known and the stall
    lasted twice the timeout, or no round formed within the start-up timeout; never on a guess.
    """
    if clocks.start is None or clocks.reached_min is None or census.ready < spec.min_replicas:
        return None
    quiet_since = quiet_from(progress.at, clocks.reached_min)
    no_round = progress.round is None
    overdue, late_start = _overdue(spec, clocks.start, quiet_since, not no_round, clocks.now)
    if not overdue and not late_start:
        return None
    quiet = clocks.since(quiet_since)
    if milestones.get("reachable"):
        known = True
        if no_round:
            cause = "no rendezvous round formed: the workers do not join the rendezvous (read their logs)"
        elif progress.step is None:
            cause = (
                f"no new rendezvous round or checkpoint since {quiet_since}, and its workers use no CPU (the program "
                "reports no steps: a hang in a collective?)"
            )
        else:
            cause = f"no new rendezvous round, step or checkpoint since {quiet_since}"
    elif etcd_state is not None:
        known = True
        cause = f"the managed etcd is not serving: {etcd_state}"
    else:
        known = False
        cause = "the operator cannot read the job's etcd (a NetworkPolicy or DNS?), so cannot tell whether it trains"
    message = f"{census.ready} worker(s) ready, no progress since {quiet_since}: {cause}"
    fail = known and (late_start or quiet > 2 * spec.stall_timeout_seconds)
    reason = conditions.STARTUP_TIMEOUT if late_start else conditions.STALLED_TOO_LONG
    return Stall(message, fail, reason)


def stalled_condition(conds: list[dict[str, Any]], found: Stall | None, now: datetime) -> list[dict[str, Any]]:
    if found is None:
        return conditions.clear_condition(conds, conditions.STALLED, "Progressing", "the run makes progress", now)
    return conditions.set_condition(conds, conditions.STALLED, True, "NoProgress", found.message, now)


def outcome(
    spec: JobSpec,
    census: verdicts.Census,
    failures: int,
    clocks: Clocks,
    last_failure: Mapping[str, Any] | None,
    *,
    stalled: Stall | None = None,
) -> tuple[str, str, str] | None:
    """(phase, reason, message) if the job finishes in this reconcile: success first, then failure rules;
    `failures` is the job's count so far, this reconcile's included."""
    if census.succeeded:
        names = ", ".join(sorted(verdicts.pod_name(p) for p in census.succeeded))
        return conditions.PHASE_SUCCEEDED, "RunCompleted", f"the run completed: worker pod {names} exited 0"
    if failures > spec.max_restarts:
        last = (
            f" (last: {last_failure['pod']}, {last_failure['reason']}: {last_failure['message']})"
            if last_failure
            else ""
        )
        message = f"{failures} worker failures exceed failurePolicy.maxRestarts {spec.max_restarts}{last}"
        return conditions.PHASE_FAILED, conditions.TOO_MANY_FAILURES, message
    if clocks.start is None:  # suspended: no clock runs
        return None
    if spec.active_deadline_seconds is not None and clocks.since(clocks.start) > spec.active_deadline_seconds:
        message = f"active for more than activeDeadlineSeconds {spec.active_deadline_seconds} s since {clocks.start}"
        return conditions.PHASE_FAILED, conditions.DEADLINE_EXCEEDED, message
    if clocks.reached_min is None and clocks.since(clocks.start) > spec.startup_timeout_seconds:
        message = (
            f"minReplicas {spec.min_replicas} not reached within failurePolicy.startupTimeoutSeconds "
            f"{spec.startup_timeout_seconds} s of {clocks.start} ({census.ready} ready)"
        )
        return conditions.PHASE_FAILED, conditions.STARTUP_TIMEOUT, message
    if stalled is not None and stalled.fail:
        limit = (
            spec.startup_timeout_seconds
            if stalled.reason == conditions.STARTUP_TIMEOUT
            else 2 * spec.stall_timeout_seconds
        )
        return conditions.PHASE_FAILED, stalled.reason, f"stalled for more than {limit} s: {stalled.message}"
    if clocks.below_since is not None and clocks.since(clocks.below_since) > spec.below_min_grace_seconds:
        message = (
            f"ready workers stayed below minReplicas {spec.min_replicas} for more than "
            f"failurePolicy.belowMinGraceSeconds {spec.below_min_grace_seconds} s (since {clocks.below_since})"
        )
        return conditions.PHASE_FAILED, conditions.BELOW_MIN_TOO_LONG, message
    return None


def finished_conditions(
    conds: list[dict[str, Any]], phase: str, reason: str, message: str, now: datetime, *, stall: Stall | None = None
) -> list[dict[str, Any]]:
    done = "the job succeeded" if phase == conditions.PHASE_SUCCEEDED else "the job failed"
    conds = conditions.set_condition(conds, phase, True, reason, message, now)
    for kind in (  # Stalled stays as it was: it says why a stalled job failed
        conditions.RUNNING, conditions.SCALING, conditions.BELOW_MIN, conditions.WAITING_FOR_CAPACITY,
        conditions.EVICTION_BUDGET,
    ):  # fmt: skip
        conds = conditions.clear_condition(conds, kind, reason, done, now)
    if stall is not None:  # the job failed of it: Stalled says the cause
        conds = stalled_condition(conds, stall, now)
    return conds


def suspended_conditions(conds: list[dict[str, Any]], census: verdicts.Census, now: datetime) -> list[dict[str, Any]]:
    stopping = f"; {len(census.active)} worker pod(s) stopping" if census.active else ""
    conds = conditions.set_condition(
        conds,
        conditions.SUSPENDED,
        True,
        "JobSuspended",
        f"spec.suspend is true: no workers, no managed etcd{stopping}",
        now,
    )
    for kind in (
        conditions.RUNNING, conditions.SCALING, conditions.BELOW_MIN, conditions.WAITING_FOR_CAPACITY,
        conditions.STALLED,
    ):  # fmt: skip
        conds = conditions.clear_condition(conds, kind, "JobSuspended", "the job is suspended", now)
    return conds


def active_conditions(
    conds: list[dict[str, Any]],
    spec: JobSpec,
    census: verdicts.Census,
    clocks: Clocks,
    *,
    why: str | None,
    now: datetime,
) -> tuple[str, list[dict[str, Any]]]:
    """Phase and conditions of a job that is neither finished nor suspended."""
    ready = census.ready
    conds = conditions.set_condition(
        conds, conditions.CREATED, True, "ObjectsCreated", "the job's objects were created", now
    )
    conds = conditions.clear_condition(conds, conditions.SUSPENDED, "JobResumed", "spec.suspend is false", now)
    if clocks.reached_min is None:
        why = why or pending_summary(census)
        message = (
            f"{ready} of minReplicas {spec.min_replicas} worker(s) ready: {why}; the job fails if minReplicas is not "
            f"reached within failurePolicy.startupTimeoutSeconds {spec.startup_timeout_seconds} s of {clocks.start}"
        )
        conds = conditions.set_condition(
            conds, conditions.WAITING_FOR_CAPACITY, True, "MinReplicasNotReached", message, now
        )
    else:
        conds = conditions.clear_condition(
            conds,
            conditions.WAITING_FOR_CAPACITY,
            "MinReplicasReached",
            f"minReplicas reached at {clocks.reached_min}",
            now,
        )
    below = ready < spec.min_replicas
    if clocks.reached_min is None:  # not "below" a minimum it never reached: WaitingForCapacity says it
        conds = conditions.set_condition(
            conds, conditions.BELOW_MIN, False, "NotStarted", "minReplicas not reached yet since the start", now
        )
    else:
        conds = conditions.set_condition(
            conds, conditions.BELOW_MIN, below, "NotEnoughWorkers" if below else "EnoughWorkers",
            f"{ready} ready worker(s), minReplicas {spec.min_replicas}", now,
        )  # fmt: skip
    conds = conditions.set_condition(
        conds, conditions.RUNNING, not below, "Training" if not below else "WaitingForWorkers",
        f"training with {ready} worker(s)" if not below else f"{ready} of at least {spec.min_replicas} ready", now,
    )  # fmt: skip
    scaling = ready != spec.desired
    waiting = f"; {why or pending_summary(census)}" if scaling and (why or census.pending) else ""
    conds = conditions.set_condition(
        conds, conditions.SCALING, scaling, "ScalingToDesired" if scaling else "AtDesired",
        f"{ready} ready of {spec.desired} desired{waiting}", now,
    )  # fmt: skip
    if clocks.reached_min is None:
        return conditions.PENDING, conds
    if below:
        return conditions.PHASE_BELOW_MIN, conds
    return (conditions.PHASE_SCALING if scaling else conditions.PHASE_RUNNING), conds


def last_failure(census: verdicts.Census, old: Mapping[str, Any], now: datetime) -> Any:
    """`status.lastFailure`: the newest failure this reconcile judged, or the one recorded before."""
    if not census.failures:
        return old.get("lastFailure")
    name, verdict = census.failures[-1]
    return {"pod": name, "reason": verdict.reason, "message": verdict.message, "time": conditions.timestamp(now)}


def pending_summary(census: verdicts.Census) -> str:
    if not census.pending:
        return "no worker pod yet"
    first = sorted(census.pending, key=verdicts.pod_name)[0]
    return f"{len(census.pending)} pending, {verdicts.pod_name(first)}: {verdicts.waiting_reason(first)}"
