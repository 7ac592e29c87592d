"""The on-disk format (docs/FORMAT.md) in code: the path spellings, the version index and
markers, safetensors headers and the tensors' checksums. Imports nothing of the publisher or
the puller.
"""
