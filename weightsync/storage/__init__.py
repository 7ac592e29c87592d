"""Where published versions live: a directory, or a bucket (``s3://``, ``gs://``, ``az://``).

``Source`` is the small interface the bucket paths use (list, read, fetch into a local file,
put, create-if-absent, delete); ``DirectorySource`` and ``BucketSource`` implement it. A
bucket is reached through host-local files, so the format code, the apply and its verification
run unchanged:

- ``mirror.Mirror``: the objects a pull's plan names are fetched into a host-local mirror of
  the versions (placeholders of the right size for the rest, so planning prices them), and
  today's pull runs on that mirror (``puller.bucket`` drives it: this package imports neither
  side of the core);
- ``bucket_publish.BucketTarget``: a ``Publisher`` writes into a host-local staging copy of the
  run; after each commit the versions are uploaded, shards first, then the index created only
  if absent (the commit point), and pruning is mirrored, index first.

The object-store client (obstore) is an optional extra: ``pip install 'weightsync[bucket]'``.
Credentials, endpoint and region come from the environment only. See docs/BUCKETS.md.
"""

from .url import BucketURL, is_bucket_url, parse_bucket_url

__all__ = ["BucketURL", "is_bucket_url", "parse_bucket_url"]
