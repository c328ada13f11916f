"""The sandbox's cluster, one part per thing a real cluster has that the API emulator lacks: the cloud
and its nodes (cloud.py), the scheduler (scheduler.py), the kubelet (kubelet.py), and the node agent
that runs them against the API a few times a second, with a ReplicaSet's and Service routing's work
(agent.py)."""
