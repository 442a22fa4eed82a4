"""The toy model both examples share: a two-layer MoE small enough for a laptop, described the
way reshard describes any model (the fields of reshard.model_config's dicts)."""

MODEL = {
    "name": "toy-moe",
    "layers": 2,
    "hidden": 256,
    "heads": 8,
    "kv_heads": 4,
    "head_dim": 32,
    "intermediate": 0,
    "moe": {"experts": 8, "expert_intermediate": 128},
    "vocab": 1024,
    "tied_embeddings": False,
    "qk_norm": True,
    "dtype": "f32",
}

# The trainer's parallelism (Megatron: experts split over 2 EP ranks inside 4 DP ranks) and the
# engine's (vLLM: tensor parallel 2).
TRAINER = {"ep": 2, "dp": 4}
ENGINE = {"tp": 2}
