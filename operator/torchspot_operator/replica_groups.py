"""Worker pods by replica group: which pods to keep, which to make and which to delete so that the job
holds whole groups (`spec.replicaGroupSize` pods each). Pure.

A replica group holds one whole copy of a sharded model (HSDP: sharded within the group, replicated
across groups), so a pod is of use only with the rest of its group: a lost pod's replacement joins its
group, not a new one, and a job scaled down loses whole groups, the broken ones first. A pod's group is
its label (`constants.LABEL_REPLICA_GROUP`), which the operator sets when it makes the pod; a
pod's index stays the lowest free one, so a group's pods need not have neighbouring names. With groups of
one pod every pod is its own group, numbered by its index, and this is the plain rule: keep the ready
pods of lowest index, make the missing ones at the lowest free indices.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchspot_operator import constants, verdicts

__all__ = ["GroupPlan", "group_of", "plan_groups", "ready_groups"]


def group_of(pod: Mapping[str, Any], size: int) -> int:
    """A worker pod's replica group: its label, else its index's (`index // size`)."""
    said = ((pod.get("metadata", {}).get("labels") or {}).get(constants.LABEL_REPLICA_GROUP)) or ""
    return int(said) if said.isdigit() else verdicts.pod_index(pod) // size


def ready_groups(pods: Iterable[Mapping[str, Any]], size: int) -> int:
    """The groups whose `size` pods are all ready."""
    ready = Counter(group_of(pod, size) for pod in pods if verdicts.is_ready(pod))
    return sum(1 for count in ready.values() if count >= size)


@dataclass
class GroupPlan:
    """What `plan_groups` decided."""

    delete: list[Mapping[str, Any]] = field(default_factory=list)
    """Pods of the groups not kept, in the order to delete them."""
    create: list[tuple[int, int]] = field(default_factory=list)
    """(index, group) of each pod to make, in the order to make them: the kept groups' missing pods first
    (a replacement joins its group), then new whole groups."""


def plan_groups(active: Sequence[Mapping[str, Any]], *, size: int, groups: int, taken: set[int]) -> GroupPlan:
    """Keep `groups` of the groups the `active` pods form (whole ones first, then those with more ready
    pods, then the lowest numbers), delete the others' pods, and make what the kept groups lack and the
    new groups needed to reach `groups`, at the lowest indices not in `taken` (which grows)."""
    members: dict[int, list[Mapping[str, Any]]] = {}
    for pod in active:
        members.setdefault(group_of(pod, size), []).append(pod)

    def rank(group: int) -> tuple[bool, int, int]:
        pods = members[group]
        return len(pods) < size, -sum(1 for pod in pods if verdicts.is_ready(pod)), group

    order = sorted(members, key=rank)
    kept, dropped = order[:groups], order[groups:]
    result = GroupPlan()

    def worst_first(pods: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        return sorted(pods, key=lambda p: (verdicts.is_ready(p), -verdicts.pod_index(p)))

    for group in reversed(dropped):  # the broken ones, then the highest numbers
        result.delete.extend(worst_first(members[group]))
    for group in kept:  # more pods than a group holds (made twice from a stale view): the surplus goes
        result.delete.extend(worst_first(members[group])[: max(0, len(members[group]) - size)])

    def free_index() -> int:
        index = 0
        while index in taken:
            index += 1
        taken.add(index)
        return index

    for group in sorted(kept):
        result.create.extend((free_index(), group) for _ in range(max(0, size - len(members[group]))))
    used = set(members)
    number = 0
    for _ in range(groups - len(kept)):
        if size == 1:  # a group of one is its pod, numbered by its index
            result.create.append((index := free_index(), index))
            continue
        while number in used:
            number += 1
        used.add(number)
        result.create.extend((free_index(), number) for _ in range(size))
    return result
