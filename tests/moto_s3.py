"""A local S3-compatible server (moto's server mode) for store tests: started by the test, stopped by it.

`s3_endpoint` (module scope) runs the server; `bucket` points the AWS variables at it and makes an empty bucket
per test. Nothing here talks to a remote server."""

from __future__ import annotations

import hashlib

import pytest

from bench.local_s3 import start_local_s3

S3_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
               "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("moto", minversion="5.2.5")  # 5.2.1 answers pyarrow's CompleteMultipartUpload with an error
    server, endpoint = start_local_s3()
    try:
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch, request):
    """(pyarrow filesystem, bucket name): an empty bucket on the local server, the AWS variables pointing at it."""
    import pyarrow.fs as pafs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]  # parametrized tests get their own
    name = f"b-{request.node.name.replace('_', '-')[:40].lower().strip('-')}-{digest}"
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint.split("://")[1], scheme="http", region="us-east-1",
                           access_key="testing", secret_key="testing", allow_bucket_creation=True)
    fs.create_dir(name)
    return fs, name


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No AWS credentials anywhere the store looks."""
    for var in S3_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
