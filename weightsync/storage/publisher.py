"""``Publisher`` on a bucket URL: the same publisher on a host-local staging copy, uploading
each committed version (``bucket_publish.BucketTarget``). ``Publisher("s3://...")`` returns one."""

from __future__ import annotations

from ..errors import PublishError
from ..publisher.publish import Publisher
from .bucket_publish import BucketTarget


class BucketPublisher(Publisher):
    """A ``Publisher`` whose source dir is a bucket URL. The staging copy is
    ``$WEIGHTSYNC_BUCKET_STAGING_DIR/<hash of the URL>`` (default under ``~/.cache/weightsync``);
    the post-write hook gets the staging copy's version dir, after the upload. One rank for now."""

    def __init__(self, source_dir: str, **kwargs):
        if kwargs.get("world_size", 1) != 1:
            raise PublishError(
                f"publishing to {source_dir} with several ranks is not supported yet: publish from one rank "
                "(gather the tensors first), or publish into a shared dir"
            )
        target = BucketTarget(source_dir)
        target.check_conditional_create()  # refuse a store without If-None-Match before anything
        if kwargs.get("rank", 0) == 0:
            target.sync_run_identity()
        self.bucket = target
        self.bucket_url = str(target.url)
        super().__init__(target.staging_dir, **kwargs)

    def _after_commit(self, vdir: str) -> None:
        # Upload first (a retry after a failed upload lands here again: the index is local),
        # then the hook and pruning of the staging copy, then the same pruning in the bucket.
        self.bucket.upload_committed()
        super()._after_commit(vdir)
        self.bucket.mirror_pruned()


__all__ = ["BucketPublisher"]
