"""Where shards live besides local disks: one interface to object stores (`cat.storage.stores`),
S3-compatible stores through boto3 (`cat.storage.s3`), every other store fsspec knows
(`cat.storage.fsspec_store`).

This package depends only on the standard library, braceexpand and the store clients
(boto3/botocore, fsspec), which are imported only when a URL of their store is used, so
the loader and the packer above it can both use it.
"""
