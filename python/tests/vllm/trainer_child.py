"""The trainer side inside one process (test_trainer.py runs it in .deps/vllm-venv): a trainer
holding a Hugging Face model (transformers, step 2's weights) publishes it through vLLM's
trainer-side engine for the `reshard` backend, and an offline engine started from step 1
installs it. Prints one JSON line of what it saw.

    python trainer_child.py ETCD FAMILY STEP1_DIR STEP2_DIR
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = [[1, 2, 3, 4], [100, 200, 300], [7] * 6, [511, 0, 42, 17, 256], [300, 301]]


def main():
    etcd, family, step1, step2 = sys.argv[1:5]
    import torch
    import transformers
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import reshard.vllm

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)

    def engine(path, backend):
        kw = {"weight_transfer_config": WeightTransferConfig(backend="reshard")} if backend else {}
        return LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128,
                   max_num_seqs=8, enforce_eager=True, seed=0, **kw)

    def tokens(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    ref = engine(step2, False)
    want = tokens(ref)
    del ref
    llm = engine(step1, True)
    before = tokens(llm)
    # The trainer: an HF model holding step 2, its parameters published in place.
    hf = transformers.AutoModelForCausalLM.from_pretrained(step2, dtype=torch.bfloat16)
    info = reshard.vllm.ReshardTrainerInitInfo(
        rank=0, rendezvous=etcd, model=f"trainer-{family}-{os.getpid()}",
        architecture=hf.config.to_dict(), transport="cma", timeout=60, first_step=2)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=reshard.vllm.LLMClient(llm), source=ModuleSource(hf))
    t = time.perf_counter()
    step = trainer.send_weights()
    send_s = time.perf_counter() - t
    after = tokens(llm)
    version = llm.get_weight_version()
    trainer.shutdown()
    print(json.dumps({"step": step, "send_s": send_s, "version": version,
                      "before_differs": before != want, "after_equals": after == want,
                      "after": after, "want": want}))


if __name__ == "__main__":
    main()
