"""Tiny random models of each architecture of the GPT-J family, as transformers configs."""

VOCAB = 256

# Tiny random models of each architecture; no eos token, so transformers' generate runs to its length.
COMMON = dict(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None)

NEOX = dict(
    model_type="gpt_neox", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
    rotary_pct=0.25, max_position_embeddings=64, **COMMON,
)  # fmt: skip
ARCHS = {
    "neox-parallel": NEOX,
    # the other residual form, without attention biases and with the head tied to the embedding
    "neox-sequential": {**NEOX, "use_parallel_residual": False, "attention_bias": False, "tie_word_embeddings": True},
    # the local layers' 5-token window is shorter than every test sequence
    "gpt-neo": dict(
        model_type="gpt_neo", hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=5, max_position_embeddings=64, **COMMON,
    ),
    # 8 heads in CodeGen's 4 qkv_proj groups: two heads per group
    "codegen": dict(model_type="codegen", n_embd=64, n_layer=2, n_head=8, rotary_dim=4, n_positions=64, **COMMON),
}  # fmt: skip
