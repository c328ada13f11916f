"""Checkpoints in Blob or a folder: commit and resume rules (manager.py), the child process that
serialises and uploads them (saver.py), and the storage behind one Protocol (storage.py)."""
