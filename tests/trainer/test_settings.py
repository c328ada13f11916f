"""Flag parsing for the etcd-v3 backend and the launcher: every bad value names its flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from torchspot_trainer.fork_server import FORK_ENV, refuse_bad_fork
from torchspot_trainer.launch import (
    BLOB_PRELOAD,
    FORK_PRELOAD,
    IN_PLACE_ENV,
    PRELOAD_ENV,
    PROGRAM_PRELOAD,
    check_args,
    fork_preload,
    forks_our_trainer,
    forks_workers,
    handle_sigterm_ourselves,
    joins_while_warming,
    leave_then_stop,
    main,
    parse_rdzv_conf,
)
from torchspot_trainer.markers import LEAVING_MARKER, PEER_LOST_ENV, RESTART_MARKER
from torchspot_trainer.rendezvous.settings import EtcdV3Settings, parse_endpoint, parse_settings


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("etcd:2379", ("etcd", 2379)),
        ("10.0.0.5", ("10.0.0.5", 2379)),
        ("job-etcd.ns.svc.cluster.local:32379", ("job-etcd.ns.svc.cluster.local", 32379)),
        ("[::1]:2379", ("[::1]", 2379)),
    ],
    ids=["host-port", "host-only", "service-dns", "ipv6"],
)
def test_parse_endpoint_accepts(text: str, want: tuple[str, int]) -> None:
    assert parse_endpoint(text) == want


def test_parse_settings_defaults_and_overrides() -> None:
    got = parse_settings("etcd:2379", "job-1", {"timeout": "900", "keep_alive_interval": "0.5", "lease_ttl": "60"})
    want = EtcdV3Settings(
        host="etcd",
        port=2379,
        run_id="job-1",
        keep_alive_interval=0.5,
        lease_ttl=60,
        join_timeout=900.0,
    )
    assert got == want
    assert got.run_prefix == "/torchspot/rdzv/job-1/"
    assert got.dead_after == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("endpoint", "run_id", "conf", "flag"),
    [
        ("", "job", {}, "--rdzv-endpoint"),
        ("http://etcd:2379", "job", {}, "--rdzv-endpoint"),
        ("etcd:0", "job", {}, "--rdzv-endpoint"),
        ("etcd:99999", "job", {}, "--rdzv-endpoint"),
        ("etcd:abc", "job", {}, "--rdzv-endpoint"),
        ("bad host:2379", "job", {}, "--rdzv-endpoint"),
        ("etcd:2379", "", {}, "--rdzv-id"),
        ("etcd:2379", "a/b", {}, "--rdzv-id"),
        ("etcd:2379", "job", {"bogus": "1"}, "--rdzv-conf bogus"),
        ("etcd:2379", "job", {"keep_alive_interval": "fast"}, "--rdzv-conf keep_alive_interval"),
        ("etcd:2379", "job", {"keep_alive_max_attempt": "0"}, "--rdzv-conf keep_alive_max_attempt"),
        ("etcd:2379", "job", {"lease_ttl": "1.5"}, "--rdzv-conf lease_ttl"),
        ("etcd:2379", "job", {"lease_ttl": "4"}, "--rdzv-conf lease_ttl"),
        ("etcd:2379", "job", {"connect_timeout": "-1"}, "--rdzv-conf connect_timeout"),
        ("etcd:2379", "job", {"liveness_interval": "0.01"}, "--rdzv-conf liveness_interval"),
        ("etcd:2379", "job", {"liveness_timeout": "-1"}, "--rdzv-conf liveness_timeout"),
        (
            "etcd:2379",
            "job",
            {"liveness_timeout": "0.5"},
            "--rdzv-conf liveness_timeout=0.5: must be 0 .off. or at least",
        ),
    ],
)
def test_parse_settings_rejects(endpoint: str, run_id: str, conf: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        parse_settings(endpoint, run_id, conf)


def test_liveness_can_be_turned_off_and_its_timeout_follows_its_interval() -> None:
    """0 leaves detection to torch's heartbeat; a timeout of three intervals is the least accepted."""
    assert parse_settings("etcd:2379", "job", {"liveness_timeout": "0"}).liveness_timeout == 0
    tuned = parse_settings("etcd:2379", "job", {"liveness_interval": "0.5", "liveness_timeout": "1.5"})
    assert (tuned.liveness_interval, tuned.liveness_timeout) == (0.5, 1.5)


def test_parse_rdzv_conf() -> None:
    assert parse_rdzv_conf(" a=1, b=x ") == {"a": "1", "b": "x"}
    assert parse_rdzv_conf("") == {}
    # torchrun itself rejects these later, deep in the agent; we reject them up front.
    for bad in ("a=1,novalue", "a=1,b=", "a=1,"):
        with pytest.raises(ValueError, match="--rdzv-conf"):
            parse_rdzv_conf(bad)


_GOOD = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-id", "j1"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--nnodes", "3:1", *_GOOD], "--nnodes '3:1': MIN (3) is larger than MAX (1)"),
        (["--nnodes", "0:2", *_GOOD], "--nnodes '0:2': the minimum"),
        (["--nnodes", "a:b", *_GOOD], "--nnodes 'a:b'"),
        (["--nnodes", "1:2:3", *_GOOD], "--nnodes '1:2:3'"),
        (["--nproc-per-node", "0", *_GOOD], "--nproc-per-node '0'"),
        (["--nproc-per-node", "many", *_GOOD], "--nproc-per-node 'many'"),
        (["--max-restarts", "-1", *_GOOD], "--max-restarts -1"),
        (["--monitor-interval", "0", *_GOOD], "--monitor-interval 0"),
        (
            ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:2379"],
            "--rdzv-id is required",
        ),
        (["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "", "--rdzv-id", "j"], "--rdzv-endpoint"),
        ([*_GOOD, "--rdzv-conf", "heartbeat=5"], "--rdzv-conf heartbeat: unknown key"),
        ([*_GOOD, "--rdzv-conf", "lease_ttl"], "--rdzv-conf 'lease_ttl'"),
        ([*_GOOD, "--rdzv-conf", "cert=/c.crt,key=/c.key"], "--rdzv-conf cert and key need cacert"),
        ([*_GOOD, "--rdzv-conf", "cacert=/ca.crt,cert=/c.crt"], "--rdzv-conf cert and key: give both"),
    ],
)
def test_launcher_rejects_bad_flags(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "train.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "torchspot-run: error:" in err
    assert flag in err


def test_check_args_accepts_torchrun_flags() -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(
        ["--nnodes", "1:4", "--nproc-per-node", "2", "--max-restarts", "3", *_GOOD, "x.py"]
    )
    assert check_args(args) is None
    stock = get_args_parser().parse_args(["--nnodes", "2", "--rdzv-backend", "c10d", "x.py"])
    assert check_args(stock) is None


@pytest.mark.parametrize(
    ("argv", "forked", "trainer"),
    [
        (["-m", "torchspot_trainer", "--epochs", "1"], True, True),
        (["train.py"], True, False),  # any Python program: run_program in a forked worker
        (["-m", "other.module"], True, False),
        (["--no-python", "torchspot-trainer"], False, False),  # not Python: started as torchrun starts it
        (["--run-path", "train.py"], False, False),
    ],
)
def test_python_programs_under_our_rendezvous_are_forked_from_a_warm_server(
    argv: list[str], forked: bool, trainer: bool
) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(["--nnodes", "1:3", *_GOOD, *argv])
    assert forks_workers(args, {}) is forked  # by default
    assert forks_our_trainer(args, {}) is trainer
    assert forks_workers(args, {FORK_ENV: "0"}) is False  # opted out
    assert forks_our_trainer(args, {FORK_ENV: "0"}) is False
    stock = get_args_parser().parse_args(["--nnodes", "1:3", "--rdzv-backend", "c10d", "-m", "torchspot_trainer"])
    assert forks_workers(stock, {FORK_ENV: "1"}) is False
    preload = fork_preload(args, {PRELOAD_ENV: "torchvision, transformers"})
    assert preload == (list(FORK_PRELOAD) if trainer else [*PROGRAM_PRELOAD, "torchvision", "transformers"])


@pytest.mark.parametrize(
    ("program", "environ", "blob"),
    [
        (["--dataset", "digits"], {}, False),
        (["--checkpoint-uri", "/ckpt"], {}, False),
        (["--checkpoint-uri", "az://checkpoints/run-1"], {}, True),
        (["--checkpoint-uri=az://checkpoints/run-1"], {}, True),
        ([], {"TORCHSPOT_CHECKPOINT_URI": "az://checkpoints/run-1"}, True),  # the operator's way
        (["--data", "az://datasets/cifar10", "--dataset", "cifar10"], {}, True),  # staged from the server
    ],
)
def test_the_blob_sdk_is_preloaded_only_for_a_trainer_that_uses_blob(
    program: list[str], environ: dict[str, str], blob: bool
) -> None:
    """Its import is on a joining node's path to its first step (0.3 s of CPU here): only where the
    trainer's checkpoints or data set are in Blob."""
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(["--nnodes", "1:3", *_GOOD, "-m", "torchspot_trainer", *program])
    assert fork_preload(args, environ) == ([*FORK_PRELOAD, BLOB_PRELOAD] if blob else list(FORK_PRELOAD))


@pytest.mark.parametrize(
    ("program", "environ", "early"),
    [
        (["-m", "torchspot_trainer", "--dataset", "digits", "--in-place"], {}, True),
        (["-m", "torchspot_trainer", "--dataset", "digits"], {IN_PLACE_ENV: "true"}, True),  # the operator's way
        (["-m", "torchspot_trainer", "--dataset", "digits", "--no-in-place"], {IN_PLACE_ENV: "true"}, False),
        (["-m", "torchspot_trainer", "--dataset", "digits"], {}, True),  # in place unless told otherwise
        (["-m", "torchspot_trainer", "--dataset", "digits", "--no-in-place"], {}, False),  # the restart path
        (["-m", "torchspot_trainer", "--dataset", "digits", "--sync-bn"], {}, False),  # which refuses in place
        (["-m", "torchspot_trainer", "--dataset", "digits"], {"TORCHSPOT_SYNC_BN": "1"}, False),
        (["-m", "torchspot_trainer", "--in-place", "--data", "az://datasets/cifar10"], {}, False),  # stages first
        (["-m", "torchspot_lab.toy_train", "--in-place"], {}, False),  # not ours: it may be restarted
    ],
)
def test_only_our_trainer_in_place_joins_while_its_server_warms(
    program: list[str], environ: dict[str, str], early: bool
) -> None:
    """A joiner whose workers re-form in place joins while its fork server imports (the others train on
    until its worker is in their group build); any other agent joins once its server is warm."""
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(["--nnodes", "1:3", *_GOOD, *program])
    assert joins_while_warming(args, environ) is early


def test_sigterm_is_ours_unless_the_user_left_it_out() -> None:
    """torch's agent is told to leave SIGTERM to us (it leaves the rendezvous first); a user's
    `--signals-to-handle` without SIGTERM is left as it is."""
    from torch.distributed.run import get_args_parser

    previous = signal.getsignal(signal.SIGTERM)
    try:
        theirs = get_args_parser().parse_args(["--signals-to-handle", "SIGINT,SIGUSR1", *_GOOD, "x.py"])
        handle_sigterm_ourselves(theirs)
        assert theirs.signals_to_handle == "SIGINT,SIGUSR1"
        assert signal.getsignal(signal.SIGTERM) is previous

        ours = get_args_parser().parse_args([*_GOOD, "x.py"])
        handle_sigterm_ourselves(ours)
        assert ours.signals_to_handle == "SIGINT,SIGHUP,SIGQUIT"
        assert signal.getsignal(signal.SIGTERM) is leave_then_stop
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_unreadable_tls_file_is_named(tmp_path: Path) -> None:
    from torchspot_trainer.rendezvous.etcd_client import EtcdTls

    with pytest.raises(ValueError, match=f"--rdzv-conf cacert={tmp_path}/absent.crt: cannot be read"):
        EtcdTls.from_conf({"cacert": str(tmp_path / "absent.crt")})
    assert EtcdTls.from_conf({}) is None  # no cacert: plain gRPC


def test_a_worker_forked_after_cuda_was_initialised_stops_naming_the_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """What CUDA reports in a child of a process that had initialised it (no GPU here: torch's own check
    is made to say so); the warm-up worker runs the same check before the node joins."""
    import torch

    refuse_bad_fork()  # a CPU build never is in a bad fork
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    with pytest.raises(SystemExit, match=f"{FORK_ENV}=0"):
        refuse_bad_fork()


@pytest.mark.parametrize("marker", [None, RESTART_MARKER, LEAVING_MARKER])
def test_a_worker_its_agent_stopped_while_it_started_stops_at_once(tmp_path: Path, marker: str | None) -> None:
    """A forked worker starts with SIGTERM ignored (the fork server's disposition), so a SIGTERM sent
    before it takes the default back is lost; the agent's mark, written before it signals, stands in."""
    if marker is not None:
        (tmp_path / marker).touch()
    code = "from torchspot_trainer.fork_server import hear_sigterm\nhear_sigterm()\nprint('ran on')"
    environ = {**os.environ, PEER_LOST_ENV: str(tmp_path / "peer-lost")}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, env=environ, capture_output=True, text=True, timeout=60
    )
    if marker is None:
        assert (done.returncode, done.stdout.strip()) == (0, "ran on")
    else:
        assert (done.returncode, done.stdout) == (-signal.SIGTERM, "")


def test_the_agent_logs_a_failed_worker_without_importing_torch_compile() -> None:
    """torch's log formatter imported torch._dynamo to print any traceback: 2.2-2.5 s of the agent's
    main thread when it logged its failed worker group, the restart path's hard loss (launch.py's
    `format_tracebacks_plainly`). A fresh interpreter logs such a failure as the agent does: the
    traceback is printed, torch._dynamo is not imported. Fails without the filter."""
    code = (
        "import logging, sys\n"
        "import torch.distributed.elastic.multiprocessing.api\n"
        "from torchspot_trainer.launch import format_tracebacks_plainly\n"
        "format_tracebacks_plainly()\n"
        "try:\n"
        "    raise RuntimeError('the worker failed')\n"
        "except RuntimeError:\n"
        "    logging.getLogger('torch.distributed.elastic.multiprocessing.api').exception('failed')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = _fresh_python(code)
    assert done.stdout.strip() == "False"
    assert "RuntimeError: the worker failed" in done.stderr
    assert "Traceback (most recent call last)" in done.stderr


def test_the_launcher_loads_the_etcd_client_only_when_it_registers_the_backend() -> None:
    """The handler's etcd client (pyetcd, gRPC) is the agent's alone: imported at the launcher's top it
    delayed the fork server, whose imports a joining node's first step waits for, and every worker
    inherited gRPC. A fresh interpreter imports the launcher, leaves a rendezvous it never joined (a
    SIGTERM that early: nothing to do), and only `register` loads the client."""
    code = (
        "import sys\n"
        "from torchspot_trainer import launch\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'pyetcd') or m == "
        "launch.HANDLER_MODULE)\n"
        "launch.leave_rendezvous()\n"
        "print(loaded())\n"
        "launch.register()\n"
        "print(launch.HANDLER_MODULE in loaded(), 'grpc' in loaded())\n"
    )
    assert _fresh_python(code).stdout.splitlines() == ["[]", "True True"]


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """`code` run in a new interpreter (what it imports is then its own), which must succeed."""
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_a_forked_programs_uncaught_exception_reaches_its_own_excepthook_then_fails_the_worker(tmp_path: Path) -> None:
    """run_program (a Python program in a worker forked by torchspot-run) hands an uncaught exception to the
    program's own sys.excepthook, as `python` would: the recovery API's keeps the node's snapshot there
    (multiprocessing, which starts a forked worker, never calls it). The exception still fails the worker."""
    script, said = tmp_path / "train.py", tmp_path / "hooked.txt"
    script.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "sys.excepthook = lambda kind, value, trace: Path(sys.argv[1]).write_text(f'{kind.__name__}: {value}')\n"
        "raise RuntimeError('a peer was lost')\n"
    )
    driver = (  # as multiprocessing starts a forked worker: the exception printed, no hook called
        "import os, sys\n"
        "from torchspot_trainer.fork_server import run_program\n"
        "try:\n"
        f"    run_program({str(script)!r}, 'script', {str(said)!r})\n"
        "except BaseException as exc:\n"
        "    print(f'{type(exc).__name__}: {exc}', file=sys.stderr, flush=True)\n"
        "    os._exit(1)\n"
    )
    ran = subprocess.run([sys.executable, "-c", driver], check=False, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1, ran.stderr[-2000:]
    assert "RuntimeError: a peer was lost" in ran.stderr  # (raised on: torch's error file and report)
    assert said.read_text() == "RuntimeError: a peer was lost"
