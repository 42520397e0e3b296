"""One-host disaggregated serving of a bundle with vLLM: a prefill instance, a decode instance and a proxy.

    python -m neffbuild.vllm.di BUNDLE [--port 8000]      (tools/vllm_di.sh BUNDLE runs it in .venv-vllm)

Both instances are ``vllm serve`` on the bundle folder with the plugin (the settings ``neffbuild inspect BUNDLE
--vllm-config --json`` prints) and the plugin's KV connector (neffbuild/vllm/connector.py), each on its own HTTP
port and NIXL side-channel port; the prefill one is ``kv_producer``, the decode one ``kv_consumer``. With an
EAGLE3 bundle both get its ``--speculative-config`` (part of the printed settings): the prefill instance drafts
over the prompt, so the draft's KV moves with the target's, and the decode instance speculates from each
request's second step (neffbuild/vllm/connector.py). The proxy on
127.0.0.1 takes OpenAI completions: it sends the prefill instance the request with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``, then the decode instance the original request with the
``kv_transfer_params`` the prefill answer carries; the decode instance's answer is the client's. The launcher
prints the URL once both instances are healthy, and stops everything it started on Ctrl-C, SIGTERM, or when one
instance dies (exit status 1, naming it and its log). Its pieces (``start_instance``, ``wait_healthy``,
``Instance.restart``, ``make_proxy``) also start one part at a time, e.g. to restart a prefill instance that died
while the decode instance serves on (docs/vllm.md, "Faults"). Both instances get ``UCX_TLS`` (below) unless the
environment sets it.

Standard library only here: vLLM runs in the instances, and the tests build the same command lines from this
module in the project's own venv.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from neffbuild import engine_flags
from neffbuild.ports import free_port

CONNECTOR = {"kv_connector": "NeffbuildNixlConnector", "kv_connector_module_path": "neffbuild.vllm.connector",
             "kv_buffer_device": "cpu"}
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
ROUTES = ("/v1/completions", "/v1/chat/completions")
# UCX's transports for the instances' NIXL agents (a UCX_TLS in the environment wins): shared memory between the
# two processes (``sm``: UCX reads the peer's registered DRAM with CMA), ``tcp`` to wire up and for a peer on
# another host; docs/benchmarks.md, "Disaggregated serving in vLLM", has the transports measured
UCX_TLS = "tcp,sm,self"


def plugin_settings(bundle: str, neffbuild: str) -> dict:
    """What ``neffbuild inspect BUNDLE --vllm-config --json`` prints (the one place the settings are made)."""
    res = subprocess.run([neffbuild, "inspect", str(bundle), "--vllm-config", "--json"], capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise SystemExit(f"error: `neffbuild inspect {bundle} --vllm-config` failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def kv_transfer_config(role: str, connector: dict | None = None) -> str:
    """--kv-transfer-config for ``role`` (prefill | decode); ``connector``: another connector (a test's plain vLLM)."""
    return json.dumps({**(connector or CONNECTOR), "kv_role": ROLES[role]})


def serve_argv(vllm: str, settings: dict, port: int, role: str, extra: list[str] = (),
               connector: dict | None = None) -> list[str]:
    """``vllm serve BUNDLE`` with the plugin's settings, the connector for ``role`` (``connector``: the plugin's
    with other settings, e.g. a benchmark's ``kv_connector_extra_config``) and 127.0.0.1:``port``."""
    argv = [vllm, "serve", settings["model"], *engine_flags.argv(settings["engine_args"])]
    argv += ["--additional-config", json.dumps(settings["additional_config"]),
             "--kv-transfer-config", kv_transfer_config(role, connector),
             "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m", *extra]
    return argv


class Instance:
    """One ``vllm serve`` process (its own session: stopping it stops vLLM's engine core too), its log a file."""

    def __init__(self, name: str, argv: list[str], port: int, side_port: int, log: Path, env: dict | None = None):
        self.name, self.argv, self.port, self.side_port, self.log_path = name, argv, port, side_port, log
        self.url = f"http://127.0.0.1:{port}"
        self.env = dict(env or os.environ, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port),
                        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1")
        self.env.setdefault("UCX_TLS", UCX_TLS)
        self._log = open(log, "a")  # noqa: SIM115 - closed in stop(); "a": a restart's log follows the first's
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def healthy(self) -> bool:
        return healthy(self.url)

    def restart(self, side_port: int | None = None) -> Instance:
        """The same instance again (same command, HTTP port and log) after this one stopped or died, on
        ``side_port`` (default: the same NIXL side-channel port; the prefill answer tells the decode side which)."""
        self.stop()
        return Instance(self.name, self.argv, self.port, side_port or self.side_port, self.log_path, self.env)

    def stop(self, grace: float = 30) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def start_instance(name: str, vllm: str, settings: dict, log_dir: Path, *, port: int = 0, extra: list[str] = (),
                   env: dict | None = None, connector: dict | None = None) -> Instance:
    """``vllm serve`` on the bundle as the ``name`` (prefill | decode) side, on ``port`` (0: any free one) and a
    free side-channel port, its log ``log_dir/NAME.log``."""
    port = port or free_port()
    return Instance(name, serve_argv(vllm, settings, port, name, list(extra), connector), port, free_port(),
                    Path(log_dir) / f"{name}.log", env)


def check_alive(instances: list[Instance]) -> None:
    for i in instances:
        if i.proc.poll() is not None:
            raise SystemExit(f"error: the {i.name} instance exited with status {i.proc.returncode} "
                             f"(log: {i.log_path})")


def wait_healthy(instances: list[Instance], timeout: float) -> None:
    """Until every instance answers /health; SystemExit naming the one that died, or the logs after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not all(i.healthy() for i in instances):
        check_alive(instances)
        if time.monotonic() > deadline:
            raise SystemExit(f"error: the instances are not healthy after {timeout} s (logs: "
                             f"{', '.join(str(i.log_path) for i in instances)})")
        time.sleep(1)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def prefill_body(body: dict) -> dict:
    """The prefill leg: one token, no stream, and the ask to keep the KV for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                 "remote_engine_id": None, "remote_block_ids": None,
                                                 "remote_host": None, "remote_port": None})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def make_proxy(prefill_url: str, decode_url: str, port: int, timeout: float = 600) -> ThreadingHTTPServer:
    """The proxy (not started): prefill leg, then decode leg with the prefill answer's kv_transfer_params."""

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):  # one line per request on stderr would drown the launcher's own
            pass

        def _reply(self, status: int, doc: dict) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                ok = healthy(prefill_url) and healthy(decode_url)
                return self._reply(200 if ok else 503, {"healthy": ok})
            return self._forward_get(decode_url + self.path)

        def _forward_get(self, url: str):
            try:
                with urllib.request.urlopen(url, timeout=30) as r:
                    return self._reply(r.status, json.loads(r.read()))
            except urllib.error.HTTPError as e:
                return self._reply(e.code, {"error": e.read().decode(errors="replace")})

        def do_POST(self):
            if self.path not in ROUTES:
                return self._reply(404, {"error": f"{self.path}: the proxy serves {', '.join(ROUTES)}"})
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            try:
                with post(prefill_url + self.path, prefill_body(body), timeout) as r:
                    params = json.loads(r.read()).get("kv_transfer_params")
            except urllib.error.HTTPError as e:  # the request's own fault (e.g. too long): its status, not 502
                return self._reply(e.code, {"error": f"prefill instance {prefill_url}: {_why(e)}"})
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
                # an instance killed mid-answer is a closed connection or a short body, not an HTTP error
                return self._reply(502, {"error": f"prefill instance {prefill_url}: {_why(e)}"})
            if not params:
                return self._reply(502, {"error": f"prefill instance {prefill_url} returned no kv_transfer_params "
                                                  "(is it started with the plugin's KV connector as kv_producer?)"})
            try:
                upstream = post(decode_url + self.path, dict(body, kv_transfer_params=params), timeout)
            except urllib.error.HTTPError as e:
                return self._reply(e.code, {"error": f"decode instance {decode_url}: {_decode_why(e, prefill_url)}"})
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                return self._reply(502, {"error": f"decode instance {decode_url}: {_why(e)}"})
            with upstream:
                self.send_response(upstream.status)
                self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
                self.end_headers()
                while chunk := upstream.read1(65536):  # a stream passes through as it comes
                    self.wfile.write(chunk)
                    self.wfile.flush()

    return ThreadingHTTPServer(("127.0.0.1", port), Proxy)


def _why(err: Exception) -> str:
    if isinstance(err, urllib.error.HTTPError):
        try:  # an instance killed while it sends an error's body: the status is all there is
            body = err.read().decode(errors="replace")[:500]
        except (OSError, http.client.HTTPException):
            body = "(the answer's body was cut off)"
        return f"HTTP {err.code}: {body}"
    return str(getattr(err, "reason", err)) or type(err).__name__


def _decode_why(err: urllib.error.HTTPError, prefill_url: str) -> str:
    """The decode leg's error; a server error also names the prefill instance the prompt's KV was to come from.

    vLLM's answer to a failed KV pull is a bare "Internal server error", and whether the prefill instance still
    answers /health at that moment is a race with its death (its API server can outlive its worker by a moment),
    so the prefill instance is named whatever the health check says; the check only adds that it is down."""
    why = _why(err)
    if err.code >= 500:
        why += f"; the prompt's KV was to be pulled from the prefill instance {prefill_url}"
        if not healthy(prefill_url):
            why += ", which is down (retry once it is back)"
    return why


class Launch:
    """The two instances and the proxy; ``stop`` ends every one it started (idempotent)."""

    def __init__(self, args):
        self.args, self.instances, self.proxy = args, [], None
        self.logs = Path(args.log_dir or tempfile.mkdtemp(prefix="neffbuild-vllm-di-"))
        self.logs.mkdir(parents=True, exist_ok=True)
        self._stopped = threading.Event()

    def start(self) -> str:
        a = self.args
        settings = plugin_settings(a.bundle, a.neffbuild)
        for name, port, own in (("prefill", a.prefill_port, a.prefill_arg), ("decode", a.decode_port, a.decode_arg)):
            self.instances.append(start_instance(name, a.vllm, settings, self.logs, port=port,
                                                 extra=[*a.vllm_arg, *own]))
        wait_healthy(self.instances, a.startup_timeout)
        self.proxy = make_proxy(self.instances[0].url, self.instances[1].url, a.port or free_port())
        threading.Thread(target=self.proxy.serve_forever, daemon=True, name="proxy").start()
        return f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def check_alive(self) -> None:
        check_alive(self.instances)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.proxy is not None:
            self.proxy.shutdown()
            self.proxy.server_close()
        for i in self.instances:
            i.stop()


def parse(argv: list[str] | None = None):
    bin_dir = Path(sys.executable).parent
    p = argparse.ArgumentParser(prog="python -m neffbuild.vllm.di", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", help="the bundle folder (both instances serve it)")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port on 127.0.0.1 (0: any free port)")
    p.add_argument("--prefill-port", type=int, default=0, help="the prefill instance's HTTP port (0: any free)")
    p.add_argument("--decode-port", type=int, default=0, help="the decode instance's HTTP port (0: any free)")
    p.add_argument("--vllm", default=shutil.which("vllm", path=str(bin_dir)) or "vllm", help="the vllm command")
    p.add_argument("--neffbuild", default=shutil.which("neffbuild", path=str(bin_dir)) or "neffbuild",
                   help="the neffbuild command (for `inspect --vllm-config`)")
    p.add_argument("--log-dir", help="where each instance's log goes (default: a new temporary folder)")
    p.add_argument("--vllm-arg", action="append", default=[], help="one more `vllm serve` argument for both")
    p.add_argument("--prefill-arg", action="append", default=[], help="one more argument for the prefill instance")
    p.add_argument("--decode-arg", action="append", default=[], help="one more argument for the decode instance")
    p.add_argument("--startup-timeout", type=float, default=600)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    launch = Launch(parse(argv))

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started in the background, where SIGINT is ignored
    try:
        url = launch.start()
        i = launch.instances
        print(f"neffbuild vllm-di: serving {launch.args.bundle} at {url}/v1 (prefill {i[0].url}, decode "
              f"{i[1].url}; logs {launch.logs})", flush=True)
        while True:
            launch.check_alive()
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    except SystemExit as stop:
        print(stop.code, file=sys.stderr, flush=True)
        return 1
    finally:
        launch.stop()


if __name__ == "__main__":
    sys.exit(main())
