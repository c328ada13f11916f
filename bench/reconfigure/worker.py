"""One rank of bench/reconfigure: all-reduces at a steady pace, and at a new membership re-forms the way its
method says, then goes on; what it saw goes to the store for the harness (run.py).

- `generations`: torchspot's way (recovery/live.py): each membership gets a gloo ProcessGroup of its own,
  built over the round's store under the generation's prefix; a collective of an older one is left as it is.
- `reconfigure`: torch 2.14's experimental API: one gloo group made with `enable_reconfigure=True`, re-formed
  in place by `dist._reconfigure(uuid, handles)` with the members' handles in rank order.

The membership comes from the store (`members/<g>`: the ranks of the old generation that stay, in their
new order; `store/<g>`: the host:port of generation g's store), as torchspot's agent hands each worker a
round. A watcher thread polls it every POLL seconds, as the worker's hand-over watcher reads its file.
"""

from __future__ import annotations

import argparse
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore  # what torch.distributed re-exports

POLL = 0.002
TIMEOUT = timedelta(seconds=20)


def _store(address: str) -> Any:
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.harness = _store(args.harness)
        self.rank, self.world, self.generation = args.rank, args.world, 1
        self.newer = threading.Event()
        self.group: Any = None
        self.graves: list[Any] = []
        """Older generations' groups, kept referenced (as recovery/live.py keeps them)."""
        self.formed = False
        """A re-form happened and no step completed in its generation yet."""

    def report(self, key: str, value: object) -> None:
        self.harness.set(f"{key}/{self.args.rank}", str(value))

    def form(self, generation: int, ranks: list[int]) -> None:
        """Enter `generation`, whose members are the old ranks `ranks` in their new order."""
        address = self.harness.get(f"store/{generation}").decode()
        new_rank = ranks.index(self.rank) if generation > 1 else self.rank
        if self.args.method == "generations":
            prefixed = PrefixStore(f"generation/{generation}/", _store(address))
            self.graves.append(self.group)  # freeing a group whose collective waits for a lost peer blocks
            self.group = dist.ProcessGroupGloo(prefixed, new_rank, len(ranks), TIMEOUT)
        else:
            if self.group is None:
                dist.init_process_group(  # type: ignore[call-arg]  # (torch 2.14's; the pin's stubs are 2.13's)
                    "gloo", store=_store(address), rank=self.rank, world_size=self.world, enable_reconfigure=True
                )
                self.group = dist.group.WORLD
            self.harness.set(f"handle/{generation}/{self.rank}", dist._get_reconfigure_handle())  # type: ignore[attr-defined]
            handles = [self.harness.get(f"handle/{generation}/{old}").decode() for old in ranks]
            dist._reconfigure(uuid=generation, handles=handles, timeout=TIMEOUT).wait()  # type: ignore[attr-defined]
        self.rank, self.world, self.generation = new_rank, len(ranks), generation

    def watch(self) -> None:
        while not self.harness.check([f"members/{self.generation + 1}"]):
            time.sleep(POLL)
        self.newer.set()

    def all_reduce(self, tensor: torch.Tensor) -> bool:
        """True when it completed in the current generation; False when a newer one came first."""
        if self.args.method == "generations":
            work = self.group.allreduce([tensor])
        else:
            work = dist.all_reduce(tensor, async_op=True)
        while not work.is_completed():
            if self.newer.is_set():
                return False
            time.sleep(0.0002)
        work.wait()  # raises where it failed (a peer's socket closed)
        return True

    def run(self) -> None:
        self.form(1, list(range(self.world)))
        threading.Thread(target=self.watch, daemon=True).start()
        step, wrong = 0, 0
        while step < self.args.steps:
            tensor = torch.full((self.args.numel,), float(self.rank + 1))
            try:
                done = self.all_reduce(tensor)
            except RuntimeError:
                done = False
                while not self.newer.wait(0.01):
                    pass
            if not done:
                ranks = [int(r) for r in self.harness.get(f"members/{self.generation + 1}").decode().split(",")]
                if self.rank not in ranks:
                    return
                started = time.time()
                self.form(self.generation + 1, ranks)
                self.newer.clear()
                threading.Thread(target=self.watch, daemon=True).start()
                self.report("formed", f"{started},{time.time()}")
                self.formed = True
                continue  # the step again, in the new generation
            expected = self.world * (self.world + 1) / 2
            wrong += int(float(tensor[0]) != expected or float(tensor[-1]) != expected)
            step += 1
            if self.formed:
                self.report("recovered", time.time())
                self.formed = False
            self.harness.add(f"steps/{self.args.rank}", 1)
            if self.harness.check(["stop"]):
                break
            time.sleep(self.args.pace)
        self.report("done", f"{step},{wrong}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--harness", required=True)
    parser.add_argument("--method", choices=["generations", "reconfigure"], required=True)
    parser.add_argument("--steps", type=int, default=10**9)
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--pace", type=float, default=0.02)
    Worker(parser.parse_args()).run()


if __name__ == "__main__":
    main()
