"""A real S3 server for tests: moto in server mode on 127.0.0.1, reached through boto3.

Use it from a test module with ``from tests.s3_server import s3_server  # noqa: F401`` (the
session fixture), then ``s3_server.env("rw")`` / ``env("ro")`` for a subprocess's
environment, ``s3_server.url()`` for a fresh ``s3://bucket/prefix``, ``s3_server.client()``
for direct access (corrupting objects, counting them).

The server runs in its own process (``python -m moto.server``) on a free port. It starts with
authentication off, creates the bucket and two IAM users — ``rw`` (every S3 action) and
``ro`` (GetObject, ListBucket, HeadObject through GetObject) — then turns authentication on
(moto's ``/moto-api/reset-auth`` with a count of 0), so from then on every request is
checked against the users' IAM policies and the default ``test`` keys are refused. That is
how read-only credentials are emulated: moto evaluates identity policies for S3 requests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

import pytest

from neffbuild.ports import free_port

BUCKET = "neffbuild-test"
REGION = "us-east-1"

_RW_POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
_RO_POLICY = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation"], "Resource": "*"}]}


def closed_endpoint() -> str:
    """An http endpoint on 127.0.0.1 where nothing listens (the remote is 'down')."""
    return f"http://127.0.0.1:{free_port()}"


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    creds: dict = field(default_factory=dict)  # name -> (access key, secret)
    proc: subprocess.Popen | None = None

    def env(self, who: str = "rw", base: dict | None = None) -> dict:
        """An environment (a copy of ``base`` or os.environ) that reaches the server as ``who`` (rw | ro | none)."""
        env = dict(os.environ if base is None else base)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE"):
            env.pop(name, None)
        access, secret = self.creds.get(who, ("AKIANOTAUSERATALL00", "not-a-secret"))
        env.update(AWS_ENDPOINT_URL_S3=self.endpoint, AWS_ACCESS_KEY_ID=access, AWS_SECRET_ACCESS_KEY=secret,
                   AWS_DEFAULT_REGION=REGION, AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_EC2_METADATA_DISABLED="true")
        return env

    def url(self, name: str | None = None) -> str:
        """A fresh ``s3://bucket/prefix`` (a unique prefix per call unless ``name`` is given)."""
        return f"s3://{self.bucket}/{name or 'p-' + uuid.uuid4().hex[:10]}"

    def client(self, who: str = "rw"):
        import boto3

        access, secret = self.creds[who]
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=access,
                            aws_secret_access_key=secret)

    def keys(self, url: str) -> dict[str, int]:
        """Every object under ``url``'s prefix -> its size."""
        prefix = url.split("/", 3)[3] + "/" if url.count("/") >= 3 else ""
        out, token = {}, None
        c = self.client()
        while True:
            kw = {"Bucket": self.bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            resp = c.list_objects_v2(**kw)
            out.update({o["Key"]: o["Size"] for o in resp.get("Contents", [])})
            if not resp.get("IsTruncated"):
                return out
            token = resp["NextContinuationToken"]


def _wait_up(endpoint: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"moto server did not answer at {endpoint} within {timeout:.0f} s")


def start_server() -> S3Server:
    """Start moto, make the bucket and the rw/ro users, turn authentication on."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_up(endpoint, proc)
        boot = {"endpoint_url": endpoint, "region_name": REGION, "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing"}
        boto3.client("s3", **boot).create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", **boot)
        creds = {}
        for who, policy in (("rw", _RW_POLICY), ("ro", _RO_POLICY)):
            iam.create_user(UserName=f"neffbuild-{who}")
            iam.put_user_policy(UserName=f"neffbuild-{who}", PolicyName=who, PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=f"neffbuild-{who}")["AccessKey"]
            creds[who] = (key["AccessKeyId"], key["SecretAccessKey"])
        req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req, timeout=5).read()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return S3Server(endpoint, BUCKET, creds, proc)


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server for the whole session (skipped when moto or boto3 is not installed)."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    server = start_server()
    yield server
    server.proc.terminate()
    try:
        server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
