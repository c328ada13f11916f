"""The sandbox's process control (torchspot_lab/local.py), on real processes, and the ports its servers take."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from pathlib import Path

from torchspot_lab.etcd import EPHEMERAL_RANGE, PORTS_FROM, free_port
from torchspot_lab.local import kill_tree, signal_tree

# A node's process tree: a root that says so in a file whenever it is continued (SIGCONT), and a few
# children, so that a signal sent down the tree one process at a time leaves the root time to run.
ROOT = r"""
import signal, subprocess, sys, time
ran = sys.argv[1]
signal.signal(signal.SIGCONT, lambda *_: open(ran, "w").write("continued"))
children = [subprocess.Popen(["sleep", "60"]) for _ in range(8)]
print("ready", flush=True)
while True:
    time.sleep(0.001)
"""


def test_a_frozen_tree_is_killed_without_running_again(tmp_path: Path) -> None:
    """A frozen node's pod deleted: its processes must not run between the freeze and their end (a
    SIGCONT before the SIGKILL let its agent write to the rendezvous: kill_tree's docstring). Without
    the fix the root wrote its file in 10 of 10 tries here."""
    ran = tmp_path / "ran"
    command = [sys.executable, "-c", ROOT, str(ran)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True) as root:
        try:
            assert root.stdout is not None
            assert root.stdout.readline() == "ready\n"
            assert signal_tree(root.pid, signal.SIGSTOP) == 9
            assert kill_tree(root.pid) == 9
            assert root.wait(10) == -signal.SIGKILL
        finally:
            if root.poll() is None:
                root.kill()
    assert not ran.exists(), "the frozen root ran before it died"


def test_a_free_port_lies_below_the_ports_outgoing_connections_take_and_is_never_one_held() -> None:
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    with contextlib.ExitStack() as stack:
        held: set[int] = set()
        for _ in range(20):
            port = free_port()
            assert PORTS_FROM <= port < low
            assert port not in held
            server = stack.enter_context(socket.socket())
            server.bind(("127.0.0.1", port))  # a server can take it
            held.add(port)
