"""A model config small enough to count by hand, shared by S07's roofline and measuring tests.

`HAND`'s FLOPs and bytes per step are counted weight by weight in tests/test_s07_roofline.py;
tests/test_s07_measuring.py attaches its floors to a benchmark run. Not a test module (test
modules import from here, never from each other), and it imports no torch or transformers.
"""
import s03_transformer as s03

# V=10, C=4, L=1, H=2, Hkv=1, D=2, I=6, tied head, q/k norms, no biases.
HAND = s03.TransformerConfig(model_type="qwen3", vocab_size=10, hidden_size=4,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=2, intermediate_size=6, max_position_embeddings=16,
                             norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
                             qk_norm=True)
