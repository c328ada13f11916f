"""What keeps work when the group changes: eviction signals (signals.py), what the group does
with a notice (notices.py), the loop's collectives and ending a broken group (group.py), the host
copy of the state (hostcopy.py), the node-local snapshot (snapshot.py), where a new round takes
its state from (resume.py), sending a state as tensors (wire.py) and RNG states (rng.py)."""
