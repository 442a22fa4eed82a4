"""A TP2 engine (issue 43, item 4): vLLM on CPU runs each tensor-parallel rank as a worker
process, so the engine's two reshard receivers each pull only their own shard (receiver ranks
0 and 1 of `tp=2`, read from vLLM's parallel state) from `reshard publish` processes of a `tp=2`
trainer, and the ranks agree on the step before either installs. llama only (qwen2's TP2 tokens
differ from its TP1 tokens in vLLM itself, so every comparison here is TP2 against TP2): after a
refit to step 1 and then step 2 the engine's greedy tokens equal a fresh TP2 engine's on step 2's
checkpoint; a rollback gives step 1's; an update of a step nobody publishes fails on both ranks
without hanging, and the engine keeps serving step 2."""

import uuid

import reshard.vllm
import tiny_models
from test_engine import Engine, Publishers, assert_tokens


def test_a_tp2_engine_refits_rank_by_rank(etcd, tmp_path, measured):
    model = f"i43-tp2-{uuid.uuid4().hex[:6]}"
    steps = {s: tiny_models.write("llama", str(tmp_path / f"ckpt-{s}"), s) for s in (1, 2)}
    folder = tmp_path / "publish"
    folder.mkdir()
    (folder / "step-1").symlink_to(steps[1])
    pubs = Publishers(etcd, model, folder, "tp=2", tmp_path)
    engine = ref = None
    try:
        pubs.wait_published(1)
        engine = Engine(steps[1], reshard=True, multiprocess=True, tp=2,
                        log_path=tmp_path / "engine.log")
        ref = Engine(steps[2], reshard=False, multiprocess=True, tp=2,
                     log_path=tmp_path / "ref2.log")
        engine.ready()
        ref.ready()
        measured.append(f"llama TP2: engine start {engine.start_s} s, reference {ref.start_s} s")
        want = {1: engine.tokens(), 2: ref.tokens()}
        assert want[1] != want[2], "step 1 and step 2 generate the same tokens at TP2"
        engine.ok("init_weight_transfer_engine", {"init_info": {
            "rendezvous": etcd, "model": model, "transport": "cma", "timeout": 60}})

        def update(info, version):
            replies = [engine.call("start_weight_update")]
            if replies[-1]["ok"]:
                replies.append(engine.call("update_weights", {"update_info": info}))
                if replies[-1]["ok"]:
                    replies.append(engine.call("finish_weight_update",
                                               weight_version=version))
            return replies

        for r in update({"step": 1, "timeout": 60}, "1"):
            assert r["ok"], r
        assert_tokens(engine.tokens(), want[1], "after a refit to step 1 at TP2")
        (folder / "step-2").symlink_to(steps[2])
        pubs.wait_published(2)
        replies = update({"step": 2, "timeout": 60}, "2")
        for r in replies:
            assert r["ok"], r
        measured.append(f"llama TP2: refit 1->2 update {replies[1]['s']} s")
        assert_tokens(engine.tokens(), want[2], "after a refit to step 2 at TP2")
        for r in update({"rollback": True}, "1"):
            assert r["ok"], r
        assert_tokens(engine.tokens(), want[1], "after a rollback at TP2")
        for r in update({"step": 2, "timeout": 60}, "2"):
            assert r["ok"], r
        failed = update({"step": 7, "timeout": 2}, "7")
        assert not failed[-1]["ok"], failed
        typed = reshard.vllm.error_from(failed[-1]["error"]["message"])
        assert typed is not None and typed.kind == "timeout", failed[-1]["error"]
        assert_tokens(engine.tokens(), want[2], "after a failed update at TP2")
    finally:
        for e in (engine, ref):
            if e is not None:
                e.close()
        pubs.close()
