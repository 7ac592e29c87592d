"""The trainer side of the core: a checkpoint snapshotted, encoded as a delta or a full
version, published atomically, and old versions pruned.
"""
