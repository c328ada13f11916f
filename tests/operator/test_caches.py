"""The operator's caches (caches.py): what a watch event and a namespace list each may change, in the
orders they can arrive in. A list may have read the API before or after a watch event the cache took;
these are the interleavings a fast operator start and a relist after a 410 produce."""

from __future__ import annotations

from typing import Any

from torchspot_operator import constants
from torchspot_operator.caches import TOMBSTONE_SECONDS, Caches


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pod(name: str, version: int, *, job: str = "a", job_uid: str = "job-a", uid: str | None = None) -> dict[str, Any]:
    refs = [{"apiVersion": constants.API_VERSION, "kind": constants.KIND, "name": job, "uid": job_uid,
             "controller": True}] if job_uid else []  # fmt: skip
    return {
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "ml", "uid": uid or f"uid-{name}", "resourceVersion": str(version),
            "labels": {constants.LABEL_JOB: job, constants.LABEL_ROLE: constants.ROLE_WORKER},
            "ownerReferences": refs, "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"nodeName": "n1", "containers": [{"name": "trainer"}]},
        "status": {"phase": "Running"},
    }  # fmt: skip


def _phases(caches: Caches) -> dict[str, str]:
    return {p["metadata"]["name"]: p["status"].get("phase", "") for p in caches.owned("Pod", "ml", "job-a")}


def test_a_list_fills_what_the_watch_has_not_shown_yet_and_keeps_only_the_projection() -> None:
    caches = Caches(Clock())
    assert caches.listed("Pod", [_pod("a-worker-0", 5)], started=99.0) == ["uid-a-worker-0"]
    (held,) = caches.owned("Pod", "ml", "job-a")
    assert "managedFields" not in held["metadata"]
    assert held["status"]["phase"] == "Running"
    assert caches.names("ml", "a") == {"a-worker-0"}


def test_a_list_never_undoes_a_newer_watch_event_or_a_deletion_it_reported() -> None:
    clock = Clock()
    caches = Caches(clock)
    caches.observe("Pod", {**_pod("a-worker-0", 7), "status": {"phase": "Failed"}})  # seen at 100
    caches.observe("Pod", _pod("a-worker-1", 3))
    caches.observe("Pod", _pod("a-worker-1", 3), deleted=True)  # deleted at 100
    caches.listed("Pod", [_pod("a-worker-0", 6), _pod("a-worker-1", 2)], started=99.0)  # read before both
    assert _phases(caches) == {"a-worker-0": "Failed"}
    assert caches.names("ml", "a") == {"a-worker-0"}


def test_an_older_version_never_replaces_a_newer_one_whatever_the_times() -> None:
    clock = Clock()
    caches = Caches(clock)
    caches.listed("Pod", [{**_pod("a-worker-0", 9), "status": {"phase": "Failed"}}], started=100.0)
    clock.now = 101.0
    caches.observe("Pod", _pod("a-worker-0", 8))  # a watch event delayed behind the list
    assert _phases(caches) == {"a-worker-0": "Failed"}


def test_a_list_forgets_only_what_it_lacks_and_was_seen_before_it_started() -> None:
    clock = Clock()
    caches = Caches(clock)
    caches.observe("Pod", _pod("a-worker-0", 1))  # at 100, deleted meanwhile without an event
    clock.now = 105.0
    caches.observe("Pod", _pod("a-worker-1", 2))  # at 105, created after the list read the API
    gone = caches.missing("ml", set(caches.listed("Pod", [], started=103.0)), started=103.0)
    assert [(e.name, e.owner) for e in gone] == [("a-worker-0", ("a", "job-a"))]
    assert set(_phases(caches)) == {"a-worker-1"}
    assert caches.missing("other", set(), started=200.0) == []  # another namespace's list forgets none of these


def test_objects_are_filed_by_their_owners_uid_and_names_by_the_job_label() -> None:
    caches = Caches(Clock())
    caches.observe("Pod", _pod("a-worker-0", 1))
    caches.observe("Pod", _pod("a-worker-1", 1, job_uid="old-a"))  # a predecessor's, same name
    caches.observe("Pod", _pod("a-worker-2", 1, job_uid=""))  # owned by nobody
    assert set(_phases(caches)) == {"a-worker-0"}
    assert caches.names("ml", "a") == {"a-worker-0", "a-worker-1", "a-worker-2"}
    etcd = {"kind": "Service", "metadata": {**_pod("a-etcd", 1)["metadata"], "labels": {}}, "spec": {}}
    caches.observe("Service", etcd)
    assert [s["metadata"]["name"] for s in caches.owned("Service", "ml", "job-a")] == ["a-etcd"]
    caches.observe("Service", etcd, deleted=True)
    caches.observe("Pod", _pod("a-worker-1", 1, job_uid="old-a"), deleted=True)
    assert caches.owned("Service", "ml", "job-a") == []
    assert caches.names("ml", "a") == {"a-worker-0", "a-worker-2"}
    assert len(caches) == 2


def test_tombstones_are_dropped_after_a_while() -> None:
    clock = Clock()
    caches = Caches(clock)
    caches.observe("Pod", _pod("a-worker-0", 1), deleted=True)
    clock.now += TOMBSTONE_SECONDS + 1
    caches.observe("Pod", _pod("a-worker-1", 1), deleted=True)
    assert list(caches._deleted) == ["uid-a-worker-1"]


def test_a_kinds_listing_drops_what_it_no_longer_has_in_its_namespace_only() -> None:
    """A watch's relist (after a 410): the deletions it missed are synthesised, for its kind and scope."""
    clock = [0.0]
    caches = Caches(clock=lambda: clock[0])
    for name in ("a", "b"):
        caches.observe("Pod", _pod(name, 1), deleted=False)
    other = _pod("c", 1)
    other["metadata"]["namespace"] = "elsewhere"
    caches.observe("Pod", other, deleted=False)
    clock[0] = 5.0
    caches.observe("Pod", _pod("d", 2), deleted=False)  # seen after the listing began: not judged by it
    gone = caches.missing_of("Pod", "ml", {"uid-a"}, started=4.0)
    assert [entry.name for entry in gone] == ["b"]
    assert caches.missing_of("Pod", "ml", {"uid-a"}, started=4.0) == []  # forgotten once
    assert caches.missing_of("Deployment", None, set(), started=4.0) == []  # another kind's listing
    assert [entry.name for entry in caches.missing_of("Pod", None, {"uid-a"}, started=4.0)] == ["c"]  # all
    assert sorted(_phases(caches)) == ["a", "d"]
