"""Tiny synthetic GGUF files for error and tensor-type tests (written with the gguf package)."""
import numpy as np


def write_tiny_llama(path, arch="llama", weight_type=None, vocab=None):
    """A 1-layer llama-family model, dim 256, 4 heads / 2 KV heads, byte-level toy vocab.

    weight_type: a gguf.GGMLQuantizationType for the projection weights (F32 when None); for
    types the gguf package cannot quantize, random bytes of the right size are written.
    """
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    dim, hidden, heads, kv, hd = 256, 512, 4, 2, 64
    tokens = vocab or ([chr(c) for c in range(33, 127)] + ["Ġ", "<|im_start|>", "<|im_end|>"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    n_vocab = len(tokens)

    def add(name, shape_out_in):
        out_f, in_f = shape_out_in
        x = (rng.standard_normal((out_f, in_f)) * 0.05).astype(np.float32)
        qt = weight_type or gguf.GGMLQuantizationType.F32
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
            return
        try:
            data = quantize(x, qt)
        except Exception:
            block, size = gguf.GGML_QUANT_SIZES[qt]
            data = rng.integers(0, 256, size=(out_f, in_f // block * size), dtype=np.uint8)
            if qt.name in ("Q4_K", "Q5_K"):  # d and dmin lead those blocks: keep them finite
                data.view(np.uint8)[:, :4] = np.frombuffer(np.float16([0.01, 0.001]).tobytes(), np.uint8)
        w.add_tensor(name, data, raw_dtype=qt)

    w.add_tensor("token_embd.weight", (rng.standard_normal((n_vocab, dim)) * 0.1).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(dim, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(dim, np.float32))
    add("blk.0.attn_q.weight", (heads * hd, dim))
    add("blk.0.attn_k.weight", (kv * hd, dim))
    add("blk.0.attn_v.weight", (kv * hd, dim))
    add("blk.0.attn_output.weight", (dim, heads * hd))
    add("blk.0.ffn_gate.weight", (hidden, dim))
    add("blk.0.ffn_up.weight", (hidden, dim))
    add("blk.0.ffn_down.weight", (dim, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
