"""A trainer that holds a Hugging Face model publishes it from its ``config.json`` (issue 43, item
2): ``reshard.Publisher(architecture=<config.json dict, file or folder>)`` with no preset,
every tensor registered in place under its HF name, and engines refit into vLLM's layouts byte
for byte (compared with vllm_reference.py, which computes vLLM's parameters from the same HF
tensors by vLLM's loading rules, not by reshard's planner).

The tensors are those of hf_models.py (the families' HF names and config keys), held in memory
as a trainer holds its model: no checkpoint file is involved."""

import json

import ml_dtypes
import numpy as np
import pytest

import hf_models
import reshard
from test_hf_checkpoints import compare
from vllm_reference import engine_tensors

FAMILIES = {
    "llama": hf_models.llama,
    "qwen2": hf_models.qwen2,
    "qwen3_moe": hf_models.qwen3_moe,
    "mixtral": hf_models.mixtral,
}
# deepseek_v3 is left out: its config.json does not say the router bias's dtype (float32 in
# DeepSeek's checkpoints, read from the safetensors headers there; what a trainer holds and
# what vLLM holds is issue 44's question).


def held(ckpt):
    """The trainer's arrays by HF name, in the dtype they hold (bf16 as ml_dtypes)."""
    out = {}
    for name, (dtype, a) in ckpt.tensors.items():
        a = np.ascontiguousarray(a)
        out[name] = a.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else a
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("given", ["dict", "file", "folder"])
def test_a_trainer_publishes_its_hf_model_from_config_json(hub, name, family, given, tmp_path):
    ckpt = FAMILIES[family](name)
    (tmp_path / "config.json").write_text(json.dumps(ckpt.config))
    architecture = {"dict": ckpt.config, "file": str(tmp_path / "config.json"),
                    "folder": tmp_path}[given]
    arrays = held(ckpt)
    pub = reshard.Publisher(model=name, architecture=architecture, topology={"tp": 1}, rank=0,
                            rendezvous=hub, transport="loopback")
    receivers = []
    try:
        # The tensors reshard expects are the HF ones, by the same names.
        assert set(pub.tensors) == set(arrays), (
            sorted(set(pub.tensors) ^ set(arrays)))
        for n, a in arrays.items():
            pub.register(n, a)
        pub.publish(1)
        layout = {"tp": 2}
        problems = []
        for rank in range(2):
            rx = reshard.Receiver(model=name, layout=layout, rank=rank, rendezvous=hub,
                                  transport="loopback", timeout=30)
            receivers.append(rx)
            report = rx.refit(timeout=30)
            assert report.verified and report.step == 1
            problems += compare(engine_tensors(ckpt, layout, rank), rx.weights(),
                                f"{family} {layout} rank {rank}")
        assert not problems, "\n".join(problems[:40])
    finally:
        for rx in receivers:
            rx.close()
        pub.close()


def test_hf_model_config_names_what_is_wrong(tmp_path):
    ckpt = hf_models.llama("x")
    cfg = reshard.hf_model_config(ckpt.config, name="mine")
    assert cfg["name"] == "mine" and cfg["layers"] == ckpt.config["num_hidden_layers"]
    assert cfg["dtype"] == "bf16"
    broken = dict(ckpt.config)
    del broken["hidden_size"]
    with pytest.raises(reshard.Config) as e:
        reshard.hf_model_config(broken)
    assert "hidden_size" in str(e.value)
    with pytest.raises(reshard.Config) as e:
        reshard.hf_model_config(tmp_path / "nowhere")
    assert "nowhere" in str(e.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(reshard.Config) as e:
        reshard.hf_model_config(tmp_path)
    assert "config.json" in str(e.value) and "JSON" in str(e.value)
