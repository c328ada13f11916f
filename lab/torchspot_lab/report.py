"""The sandbox's report: a timeline, throughput, steps lost, goodput, a plot, the same as JSON.

Inputs are what the run left behind: the sandbox's own timeline (evictions, freezes,
capacity added), the Kubernetes Events the operator posted, the job's final status,
the trainer's JSON event lines (rank 0 prints them; the node agent keeps every pod's
output), and the checkpoints committed in Blob. Everything but writing the files is
pure.

Definitions:
- steps lost: for each resumption, the newest step trained before it minus the step it
  resumed from (work that had to be redone);
- useful training time: the time between progress lines whose steps were kept (not
  redone later);
- goodput: useful training time over the time capacity was available, which here is
  the whole run from submission to the end (startup, rendezvous and checkpoint loading
  count against it, as they do on a cluster).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

EVENT_KINDS = ("start", "progress", "checkpoint", "emergency_checkpoint", "done", "eval")


@dataclass
class Report:
    """Everything the report says, ready for JSON."""

    job: str
    phase: str
    wall_seconds: float
    final_step: int
    steps_lost: int
    restarts: list[dict[str, Any]]
    samples_per_second: float
    useful_seconds: float
    goodput: float
    checkpoints: list[int]
    status: dict[str, Any]
    timeline: list[dict[str, Any]]
    series: list[dict[str, Any]] = field(default_factory=list)
    """(t, step, world size, samples/s) per progress line, for the plot."""
    agent_errors: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    """The job's objects still in the API when the run ended, `Kind name (phase)`: after a success,
    finished workers only (cleanPodPolicy); never a Pending worker or the managed etcd."""
    paths: dict[str, str] = field(default_factory=dict)
    submitted: float = 0.0
    """When the job was submitted (Unix time): the zero of every `t` here."""

    def step_sizes(self) -> str:
        """What a step meant: one number for a fixed global batch; the sizes in turn when the
        batch was per worker (the optimisation then changed with the world size)."""
        sizes = [r["step_samples"] for r in self.restarts if r.get("step_samples")]
        if not sizes:
            return "-"
        if len(set(sizes)) == 1:
            return f"{sizes[0]} (the same at every world size)"
        return " -> ".join(map(str, sizes)) + " (per-worker batches: changed with the world size)"

    def paths_taken(self) -> str:
        """How the groups after the first came to be: in place, or by restarting every worker."""
        later = self.restarts[1:]
        if not later:
            return "-"
        in_place = sum(r.get("path") == IN_PLACE for r in later)
        return f"{in_place} in place (no process restarted), {len(later) - in_place} by restarting every worker"

    def summary(self) -> str:
        """The human-readable end of a run."""
        lines = [
            f"=== torchspot sandbox report: {self.job} ===",
            f"phase                {self.phase}",
            f"wall time            {self.wall_seconds:.1f} s",
            f"final step           {self.final_step}",
            f"samples per step     {self.step_sizes()}",
            f"world sizes          {' -> '.join(str(r['world_size']) for r in self.restarts) or '-'}",
            f"steps lost           {self.steps_lost} over {max(len(self.restarts) - 1, 0)} resumptions",
            f"resumptions          {self.paths_taken()}",
            f"samples/s            {self.samples_per_second:.1f} (mean of progress lines)",
            f"goodput              {self.goodput:.1%} ({self.useful_seconds:.1f} s useful training"
            f" of {self.wall_seconds:.1f} s)",
            f"evictions            {self.status.get('evictions', 0)} (operator's count)",
            f"checkpoints in Blob  {', '.join(map(str, self.checkpoints)) or 'none'}",
            "timeline (periodic checkpoints in report.json):",
            *[f"  {e['t']:7.1f}s  {e['text']}" for e in self.timeline if e["kind"] != "committed"],
        ]
        if self.agent_errors:
            lines.append(f"node agent errors    {len(self.agent_errors)}: {self.agent_errors[0]}")
        lines.append(f"left in the cluster  {', '.join(self.left) or 'nothing'}")
        lines += [f"{key:<20} {value}" for key, value in self.paths.items()]
        return "\n".join(lines)

    def write(self, folder: Path) -> None:
        """report.json and report.png in `folder`; their paths go into `paths`."""
        self.paths = {"report": str(folder / "report.json"), "plot": str(folder / "report.png")}
        plot(self, folder / "report.png")
        (folder / "report.json").write_text(json.dumps(asdict(self), indent=2) + "\n")


def read_pod_events(pods: Path, start: float, *, job: str = "") -> list[dict[str, Any]]:
    """The trainer's JSON event lines from every pod's output (with `job`, its workers' only: a sandbox
    may run several jobs), time-ordered, `t` relative to `start`."""
    events = []
    for log in sorted(pods.glob(f"*_{job}-worker-*/log.txt" if job else "*/log.txt")):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith('{"t"'):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") in EVENT_KINDS:
                record["t"] = round(float(record["t"]) - start, 3)
                events.append(record)
    return sorted(events, key=lambda e: e["t"])


def _rounds(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each worker group's start event and its progress lines, in order."""
    rounds: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for event in events:
        if event["event"] == "start":
            rounds.append((event, []))
        elif event["event"] == "progress" and rounds:
            rounds[-1][1].append(event)
    return rounds


def _restarts(rounds: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Each (re)start with the steps it redid: how far the group before it got beyond its starting step."""
    restarts = []
    for index, (start, _) in enumerate(rounds):
        lost = 0
        if index:
            before, progress = rounds[index - 1]
            newest = max([before["step"], *(p["step"] for p in progress)])
            lost = max(newest - start["step"], 0)
        origin = start.get("resumed_from", "checkpoint" if start["step"] else "start")
        path = IN_PLACE if "generation" in start else RESTART  # (the trainer names a generation in place only)
        restarts.append({"t": start["t"], "step": start["step"], "world_size": start["world_size"], "lost": lost,
                         "from": origin, "step_samples": start.get("step_samples"), "path": path})  # fmt: skip
    return restarts


IN_PLACE, RESTART = "in place", "restart"
"""How a worker group after the first came to be (`_restarts`' `path`): its workers re-formed in the
processes they ran in, or every worker was restarted."""


def _how(restart: dict[str, Any]) -> str:
    """What a resumption's timeline line says of its path."""
    if restart["path"] == IN_PLACE:
        return ", re-formed in place (no process restarted)"
    return ", every worker restarted"


def _useful_seconds(rounds: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> float:
    """Time between consecutive progress lines of one group, for the steps no later group redid."""
    useful = 0.0
    cutoff = float("inf")  # a step above a later group's starting step was redone
    for start, progress in reversed(rounds):
        for previous, event in itertools.pairwise(progress):
            span = event["step"] - previous["step"]
            if span > 0:
                kept = max(0.0, min(event["step"], cutoff) - previous["step"])
                useful += (event["t"] - previous["t"]) * min(kept, span) / span
        cutoff = min(cutoff, start["step"])
    return useful


def build_report(
    *,
    job: str,
    submitted: float,
    status: dict[str, Any],
    timeline: list[dict[str, Any]],
    api_events: list[dict[str, Any]],
    trainer_events: list[dict[str, Any]],
    checkpoints: list[int],
    agent_errors: list[str],
    left: list[str] | None = None,
) -> Report:
    """The report of one sandbox run (pure); times are seconds since `submitted`."""
    entries = list(timeline)
    for event in api_events:  # the operator's Events (second resolution), on the run's clock
        stamp = event.get("lastTimestamp") or event.get("firstTimestamp") or event.get("eventTime")
        at = _seconds_since(stamp, submitted) if stamp else None
        text = f"{event.get('type', 'Normal')} {event.get('reason')}: {event.get('message')}"
        entries.append({"t": at if at is not None else 0.0, "kind": "k8s", "text": text})
    rounds = _rounds(trainer_events)
    restarts = _restarts(rounds)
    lost = sum(r["lost"] for r in restarts)
    for index, restart in enumerate(restarts):
        entries.append({"t": restart["t"], "kind": "round",
                        "text": f"worker group of {restart['world_size']} training from step {restart['step']}"
                                + (_how(restart) if index else "")
                                + (" (a node's local snapshot)" if restart["from"] == "snapshot" else "")
                                + (f" ({restart['lost']} steps redone)" if restart["lost"] else "")})  # fmt: skip
    for event in trainer_events:
        if event["event"] == "checkpoint" and event.get("ok"):
            entries.append(
                {"t": event["t"], "kind": "committed", "text": f"checkpoint committed at step {event['step']}"}
            )
        if event["event"] == "emergency_checkpoint":
            outcome = "ok" if event["ok"] else "FAILED"
            text = f"emergency checkpoint at step {event['step']} ({outcome})"
            entries.append({"t": event["t"], "kind": "checkpoint", "text": text})
    progress = [e for e in trainer_events if e["event"] == "progress"]
    done = [e for e in trainer_events if e["event"] == "done"]
    end = max([e["t"] for e in entries] + [e["t"] for e in trainer_events] + [0.0])
    useful = _useful_seconds(rounds)
    rates = [float(e.get("samples_per_s") or 0.0) for e in progress]
    return Report(
        job=job,
        phase=str(status.get("phase", "Unknown")) + (" (timed out)" if status.get("timedOut") else ""),
        wall_seconds=round(end, 2),
        final_step=int(done[-1]["step"]) if done else max((e["step"] for e in progress), default=0),
        steps_lost=lost,
        restarts=restarts,
        samples_per_second=round(sum(rates) / len(rates), 2) if rates else 0.0,
        useful_seconds=round(useful, 2),
        goodput=round(useful / end, 4) if end > 0 else 0.0,
        checkpoints=checkpoints,
        status=status,
        timeline=sorted(entries, key=lambda e: e["t"]),
        series=[
            {
                "t": e["t"],
                "step": e["step"],
                "world_size": e["world_size"],
                "samples_per_s": e.get("samples_per_s", 0.0),
                "round": index,
            }
            for index, (_, lines) in enumerate(rounds)
            for e in lines
        ],
        agent_errors=agent_errors,
        left=list(left or []),
        submitted=submitted,
    )


def _seconds_since(stamp: str, start: float) -> float | None:
    try:
        return round(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - start, 2)
    except ValueError:
        return None


def plot(report: Report, path: Path) -> None:
    """World size and throughput over time, with the market's events marked."""
    try:
        import matplotlib  # noqa: PLC0415 - the `lab` extra; imported only to draw

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise SystemExit("the report plot needs matplotlib: pip install 'torchspot[lab]'") from exc
    figure, (size_axis, rate_axis) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    # Each worker group trains between its first and last progress line; in between groups
    # nobody trains (world size 0), and the throughput line is not drawn across the gap.
    size_t: list[float] = [0.0]
    size_v: list[int] = [0]
    for index in sorted({p["round"] for p in report.series}):
        points = [p for p in report.series if p["round"] == index]
        size_t += [points[0]["t"], points[-1]["t"]]
        size_v += [points[0]["world_size"], 0]
        rate_axis.plot([p["t"] for p in points], [p["samples_per_s"] for p in points], color="tab:green", linewidth=1)
    size_axis.step(size_t, size_v, where="post", color="tab:blue")
    size_axis.set_ylabel("world size (0: re-forming)")
    size_axis.set_ylim(bottom=0)
    rate_axis.set_ylabel("samples/s")
    rate_axis.set_xlabel("seconds since the job was submitted")
    colours = {"evict": "tab:red", "freeze": "tab:purple", "add": "tab:olive"}
    for entry in report.timeline:
        if entry["kind"] in colours:
            for axis in (size_axis, rate_axis):
                axis.axvline(entry["t"], color=colours[entry["kind"]], linestyle="--", linewidth=1)
            size_axis.annotate(entry["text"], (entry["t"], 0.1), rotation=90, fontsize=7, va="bottom", ha="right")
    size_axis.set_title(f"{report.job}: {report.phase}, goodput {report.goodput:.0%}, {report.steps_lost} steps lost")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
