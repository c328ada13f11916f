"""Local sandbox and eviction simulation: real etcd, real agents, process-tree faults."""
