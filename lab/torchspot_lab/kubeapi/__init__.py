"""A Kubernetes API for the lab and the tests, on loopback: kmock's emulator with what an API server
adds (emulator.py), CRD admission (admission.py) and Pod Security's `restricted` profile
(podsecurity.py), served over HTTP or HTTPS with a kubeconfig (server.py).

What it does not do, the callers must not rely on: label selectors (the operator filters
again), optimistic concurrency beyond JSON patches' tests, graceful pod deletion (a deleted
pod is gone at once), controllers (no scheduler, kubelet or garbage collector: the lab's
cluster package plays those).
"""

from torchspot_lab.kubeapi.server import KubeApi

__all__ = ["KubeApi"]
