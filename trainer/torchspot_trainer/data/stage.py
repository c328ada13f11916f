"""Stage the trainer's data set on the node before its agent joins the rendezvous.

`torchspot-run` runs `stage(<the trainer's arguments>)` before it joins, for our trainer: in a process
forked from its warm server (`launch.stage_forked`), or as `python -m torchspot_trainer.data.stage
<the trainer's arguments>` where workers are not forked (`launch.staging_command`). Why: a node that
joins a running job makes every node restart its workers, and a joiner whose trainer copied an `az://`
data set (ImageNet: hours) and scanned its file index inside the new round held every other node's
GPUs in set-up meanwhile.
Staged here, the copy (`fetch.fetch_prefix`, 16 objects at a time) and the index (`node_index`)
are done before anyone waits, and the trainer finds both complete in the node's cache.

A process of its own because the agent imports nothing of the worker side (the import contract in
pyproject.toml): it names this module and waits for it, as it names the trainer; forked from the warm
server, it finds torch and the trainer imported already.
"""

from __future__ import annotations

import sys
import time

from torchspot_trainer.config import parse_config
from torchspot_trainer.data.cache import data_cache, ensure_local_data, index_cache
from torchspot_trainer.data.datasets import load_imagenet
from torchspot_trainer.data.fetch import fetch_prefix

PROG = "torchspot-run: staging"


def say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def stage(argv: list[str]) -> None:
    """Copy the data set of the trainer's `argv` to the node's cache and index its image folders."""
    config = parse_config(argv)
    if config.dataset == "digits" or not config.data:
        return
    started = time.monotonic()
    if config.data.startswith("az://"):
        cache = data_cache(config.data_cache)
        say(f"copying {config.data} to {cache} before joining the rendezvous")
        fetch_prefix(config.data, cache, progress=lambda done, total: say(f"{done:,} of {total:,} objects"))
    path = ensure_local_data(config.data, config.data_cache)  # the cache, complete now (or the local folder as given)
    if config.dataset == "imagenet":  # the trainer's own folders: their indexes are the ones it maps
        train, val = load_imagenet(path, config.image_size, index_cache(config.data_cache))
        for split, folder in (("train", train), ("val", val)):
            say(f"{split}: {len(folder):,} images in {len(folder.classes):,} classes indexed")
    say(f"data set ready in {time.monotonic() - started:.1f} s")


def main() -> None:
    stage(sys.argv[1:])


if __name__ == "__main__":
    main()
