"""The ElasticJob operator (kopf): registrations in handlers.py, one reconcile's I/O in
controller.py, the pure decisions in reconcile.py and the policies it combines, pure manifest
builders in builders.py, and the one API layer in kube.py. It imports no torch: the operator
image carries none."""
