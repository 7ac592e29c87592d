"""weightsync: publish weight versions to a shared filesystem and pull them onto every host.

The core of the project: the on-disk format (docs/FORMAT.md), codecs, checksums, publish, pull,
the per-host lock, and the ``weightsync`` command. It imports none of torch, sglang, megatron
or ray; the engine side (``sglang_patch``) and the trainer side (``miles_updater``) import it.
"""

from . import errors
from .codecs import supported_encodings
from .format.checksum import supported_checksums
from .publisher.publish import DEFAULT_ENCODING, Publisher, PublishResult, RawTensor, read_checkpoint_tensors
from .puller.plan import PullPlan, plan_pull
from .puller.pull import PullResult, applied_version, pull, wait_until_durable

# The one place the version is written: pyproject.toml reads it, `weightsync version` prints it.
__version__ = "0.1.0"

__all__ = [
    "__version__",
    "errors",
    "pull",
    "PullResult",
    "PullPlan",
    "plan_pull",
    "applied_version",
    "wait_until_durable",
    "Publisher",
    "PublishResult",
    "RawTensor",
    "read_checkpoint_tensors",
    "supported_encodings",
    "supported_checksums",
    "DEFAULT_ENCODING",
]
