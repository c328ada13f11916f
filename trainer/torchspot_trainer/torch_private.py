"""Every private torch name the project uses, in one place.

torch's private names (a leading underscore in a module, class or member) may move or change in any
release without notice. torchspot uses a few where torch offers no public way to do what it needs: the
elastic agent's and the dynamic rendezvous's internals that an in-place re-form hooks into, c10d's
store and bucket types that `torch.distributed` re-exports under private modules, a one-rank
ProcessGroup built by hand, the GradScaler's state without host syncs. Each use is listed here as
`module:qualified.name`; a member that torch's class sets in its methods rather than defines on the
class (`LocalElasticAgent._pcontext`) is listed as such and checked in the class's source.

The rule: `tests/trainer/test_torch_private.py` resolves every entry against the installed torch (an
upgrade that moves one fails there, naming it, before anything runs into it) and scans the project's
code for private torch names: a use not listed here fails the test too. Read this list before moving
the torch pin.
"""

from __future__ import annotations

__all__ = ["PRIVATE_TORCH", "SINCE_TORCH_2_14"]

PRIVATE_TORCH: tuple[str, ...] = (
    # c10d's types, re-exported by torch.distributed, defined in a private extension module
    "torch._C._distributed_c10d:GradBucket",
    "torch._C._distributed_c10d:FileStore",
    "torch._C._distributed_c10d:HashStore",
    "torch._C._distributed_c10d:PrefixStore",
    "torch._C._distributed_c10d:Store",
    "torch._C._distributed_c10d:TCPStore",
    # a one-rank gloo ProcessGroup built by hand (elastic/ddp.py)
    "torch.distributed:ProcessGroup._set_default_backend",
    "torch.distributed:ProcessGroup._register_backend",
    # aborting the default group's communicators (recovery/group.py)
    "torch.distributed.distributed_c10d:_abort_process_group",
    # CUDA in a forked worker (launch.py)
    "torch.cuda:_is_in_bad_fork",
    # the GradScaler's state without host syncs (precision.py)
    "torch.amp:GradScaler._get_scale_async",
    "torch.amp:GradScaler._growth_tracker",
    "torch.amp:GradScaler._init_growth_tracker",
    # stopping a DataLoader's workers (data/loader.py)
    "torch.utils.data.dataloader:_MultiProcessingDataLoaderIter._shutdown_workers",
    # torchrun's rendezvous configuration parser (launch.py)
    "torch.distributed.elastic.rendezvous.utils:_parse_rendezvous_config",
    # the elastic agent that re-forms in place (handover.py's InPlaceAgent)
    "torch.distributed.elastic.agent.server.api:SimpleElasticAgent._rendezvous",
    "torch.distributed.elastic.agent.server.api:SimpleElasticAgent._restart_workers",
    "torch.distributed.elastic.agent.server.api:SimpleElasticAgent._remaining_restarts",
    "torch.distributed.elastic.agent.server.api:SimpleElasticAgent._worker_group",
    "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._monitor_workers",
    "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._pcontext",
    # torch's exit barrier of a round, which a standing-by node's agent reads (handover.py's _finished_elsewhere)
    "torch.distributed.elastic.agent.server.api:_TERMINAL_STATE_SYNC_ID",
    "torch.distributed.elastic.utils.store:_NUM_MEMBERS",
    # the dynamic rendezvous that the etcd-v3 handler extends (rendezvous/handler.py)
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_delay",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_Action",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_NodeDesc",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_RendezvousContext",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_RendezvousJoinOp",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_RendezvousState",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_remove_participant_epilogue",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_BackendRendezvousStateHolder",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_BackendRendezvousStateHolder._dead_nodes",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_BackendRendezvousStateHolder._last_sync_time",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_BackendRendezvousStateHolder._sanitize",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_BackendRendezvousStateHolder._state",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_DistributedRendezvousOpExecutor",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_DistributedRendezvousOpExecutor._add_to_participants",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_DistributedRendezvousOpExecutor._mark_rendezvous_complete",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_DistributedRendezvousOpExecutor._node",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_DistributedRendezvousOpExecutor._settings",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_DistributedRendezvousOpExecutor._state",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:_DistributedRendezvousOpExecutor._state_holder",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._bootstrap_store_info",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._heartbeat_lock",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._op_executor",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._settings",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._shared_tcp_store_server",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._state_holder",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._stop_heartbeats",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._store",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler._this_node",
    # DCP's fsspec writer, still private in torch, which bench/dcp compares our Blob writer with
    "torch.distributed.checkpoint._fsspec_filesystem:FsspecWriter",
)

SINCE_TORCH_2_14: tuple[str, ...] = (
    # torch's experimental in-place reconfigure, weighed against our generation groups by bench/reconfigure
    # (run from an environment with torch 2.14); the product does not use it (docs/recovery.md says why)
    "torch.distributed:_get_reconfigure_handle",
    "torch.distributed:_reconfigure",
)
"""Private names of torch 2.14 and newer that only the benchmarks use: absent from the pinned torch
2.13, and the test says so, so that moving the pin to 2.14 checks them like the others."""
