"""The operator's log: kopf's line for every routine handler run is dropped, everything else is kept."""

from __future__ import annotations

import logging

import kopf

from torchspot_operator import handlers


def _record(level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)


def test_routine_successes_are_dropped_and_failures_kept() -> None:
    quiet = handlers.QUIET_ROUTINE
    assert not quiet.filter(_record(logging.INFO, "Handler 'job_changed' succeeded."))
    assert quiet.filter(_record(logging.ERROR, "Handler 'job_changed' failed with an exception and will try again"))
    assert quiet.filter(_record(logging.INFO, "Handler 'some_other_handler' succeeded."))  # not one of ours
    assert quiet.filter(_record(logging.INFO, "job default/cifar: phase Running"))


def test_the_routine_names_are_the_registered_handlers() -> None:
    """A renamed handler would be logged again at every event: each routine name is one kopf runs."""
    registry = kopf.get_default_registry()
    ids = {
        str(handler.id)
        for handlers_of in (registry._watching, registry._spawning)
        for handler in handlers_of.get_all_handlers()
    }
    assert ids >= handlers.ROUTINE_HANDLERS


def test_kopf_runs_no_timer_or_daemon() -> None:
    """One ticker for every job (`handlers._tick_jobs`): for a resource with a timer or a daemon kopf keeps
    the live body of every object and a finalizer on each, which a thousand jobs multiply."""
    registry = kopf.get_default_registry()
    assert list(registry._spawning.get_all_handlers()) == []
