"""The `etcd-v3` rendezvous backend for torchrun (etcd v3 API, fencing by revision)."""
