"""Where shards live besides local disks: S3-compatible object stores (`cat.storage.s3`).

This package depends only on the standard library, boto3/botocore and braceexpand, so
the loader and the packer above it can both use it.
"""
