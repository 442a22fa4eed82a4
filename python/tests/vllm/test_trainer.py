"""The trainer side (issue 43, item 2): a trainer holding a Hugging Face model publishes it
through vLLM's trainer-side weight-transfer engine for the `reshard` backend
(`WeightTransferTrainerFactory.trainer_init` with `reshard.vllm.ReshardTrainerInitInfo`, the
model's `config.json` as its architecture, `ModuleSource(model)` as the source, and
`reshard.vllm.LLMClient` driving an offline engine), and an engine started from step 1 ends up
generating exactly the tokens of a fresh engine started from step 2's checkpoint, with weight
version "2". Runs in a child process (trainer_child.py), in vLLM's in-process mode."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tiny_models

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_trainer_engine_publishes_an_hf_model_into_a_real_engine(etcd, family, tmp_path,
                                                                  measured):
    steps = {s: tiny_models.write(family, str(tmp_path / f"step-{s}"), s) for s in (1, 2)}
    done = subprocess.run([sys.executable, str(HERE / "trainer_child.py"), etcd, family,
                           steps[1], steps[2]], capture_output=True, text=True, timeout=600,
                          cwd=str(HERE))
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    assert done.returncode == 0 and lines, (
        f"the trainer child exited {done.returncode}:\n{done.stdout[-2000:]}\n"
        f"{done.stderr[-4000:]}")
    seen = json.loads(lines[-1])
    assert seen["before_differs"], "step 1 and step 2 generate the same tokens"
    assert seen["step"] == 2 and seen["version"] == "2", seen
    assert seen["after_equals"], f"after send_weights: {seen['after']} != {seen['want']}"
    measured.append(f"{family}: trainer engine send_weights (publish + engine refit) "
                    f"{seen['send_s']:.3f} s")
