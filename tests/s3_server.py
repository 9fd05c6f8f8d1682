"""A real S3-compatible server (moto's) on a loopback port, for checkpoints in a bucket."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.conftest import free_port

# The variables a client of the store reads (pyarrow and boto3 alike).
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "etrain-test",
    "AWS_SECRET_ACCESS_KEY": "etrain-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3Server:
    endpoint: str
    environ: dict[str, str]

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def new_bucket(self) -> str:
        name = f"etrain-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """The objects under ``prefix``, less the empty directory markers pyarrow writes."""
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(
            o["Key"]
            for page in pages
            for o in page.get("Contents", [])
            if not o["Key"].endswith("/")
        )


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """Start the server and point this process's S3 clients at it (restored after)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    environ = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in environ}
    os.environ.update(environ)
    try:
        yield S3Server(endpoint, environ)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
