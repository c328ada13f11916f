"""One rendezvous agent for test_liveness.py, without workers: `liveness_agent.py ENDPOINT RUN_ID NODES`.

It joins a round of NODES nodes through the etcd-v3 handler (torch's heartbeat every 5 s, so dead
only after 15 s: any sooner verdict is liveness.py's), prints `joined <node>`, then looks for a
membership change every 0.05 s, as torchrun's agent does at each monitor tick, and prints
`changed <wall time>` when it sees one, and exits.
"""

from __future__ import annotations

import sys
import time

from torch.distributed.elastic.rendezvous import RendezvousParameters

from torchspot_trainer.rendezvous.handler import create_handler


def main(endpoint: str, run_id: str, nodes: str) -> None:
    conf = {"keep_alive_interval": "5", "last_call_timeout": "30", "join_timeout": "60"}
    params = RendezvousParameters("etcd-v3", endpoint, run_id, int(nodes), int(nodes), **conf)
    handler = create_handler(params)
    handler.next_rendezvous()
    print("joined", handler._this_node, flush=True)  # type: ignore[attr-defined]
    while handler.num_nodes_waiting() == 0:
        time.sleep(0.05)
    print("changed", time.time(), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
