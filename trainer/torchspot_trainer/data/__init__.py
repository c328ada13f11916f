"""The worker's input: data sets (datasets.py), image decoding (imaging.py), copying a data set
from Blob to the node (fetch.py), the persistent loader (loader.py) and the exact-once order
(sampler.py)."""
