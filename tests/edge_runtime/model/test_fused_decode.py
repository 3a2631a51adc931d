"""The C-fused one-token decode step against the readable torch step in transformer.py."""
import pytest
import torch

from edge_runtime.model.fused_decode import KV_KIND
from edge_runtime.model.loader import load_model
from kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="C kernels unavailable here")


def test_fused_step_matches_torch_step(model_path, prose, exact_arith):
    from edge_runtime.model.tokenizer import Tokenizer

    model, gf = load_model(model_path, quant="gguf")
    ids = Tokenizer.from_metadata(gf.metadata).encode(prose)[:40]
    model.allocate_cache(128)
    with torch.inference_mode():
        model(torch.tensor(ids[:20]), 0)  # prompt through the torch path
        assert model.enable_fused(cpu_gemv.library())
        fused = [model(torch.tensor([t]), 20 + i) for i, t in enumerate(ids[20:])]
        # the same steps again through the torch path (it rewrites the same cache rows)
        model.fused = None
        plain = [model(torch.tensor([t]), 20 + i) for i, t in enumerate(ids[20:])]
    for a, b in zip(fused, plain):
        assert a.shape == b.shape == (1, model.cfg.vocab_size)
        assert (a - b).abs().max().item() < 1e-3
        assert int(a.argmax()) == int(b.argmax())


def test_backend_uses_fused_step_and_greedy_matches_unfused(model_path, exact_arith):
    from edge_runtime.backends.native import NativeBackend
    from edge_runtime.request import GenerationRequest, SamplingParams

    fused = NativeBackend(model_path, n_ctx=512)
    plain = NativeBackend(model_path, n_ctx=512, fused=False)
    assert fused.fused and not plain.fused
    req = GenerationRequest(messages=[{"role": "user", "content": "Describe a rainy day."}],
                            params=SamplingParams(max_tokens=48))
    assert fused.generate(req).token_ids == plain.generate(req).token_ids


# int8: an fp32 op-order difference that crosses a rounding boundary moves a stored K/V value by one
# quantization step (1/127 of its row's max), so the logits may differ by ~0.05 of ~20 (measured 0.0496).
@pytest.mark.parametrize("kv_dtype, tol", [("fp32", 1e-3), ("fp16", 5e-3), ("bf16", 3e-2), ("int8", 8e-2)])
def test_fused_step_on_scattered_blocks_matches_torch_step(model_path, prose, kv_dtype, tol, exact_arith):
    """One step from the same cache state, a shuffled block table, pools full of NaN beforehand: the C step
    writes K/V rounded as torch does and attends over the right slots only."""
    from edge_runtime.model.tokenizer import Tokenizer

    model, gf = load_model(model_path, quant="gguf")
    ids = Tokenizer.from_metadata(gf.metadata).encode(prose)[:40]
    model.allocate_cache(256, num_blocks=32, block_size=8, kv_dtype=kv_dtype)
    kv = model.kv
    for pool in (kv.k_pool, kv.v_pool) + ((kv.k_scale_pool, kv.v_scale_pool) if kv.quantized else ()):
        pool.fill_(127 if pool.dtype == torch.int8 else float("nan"))
    table = torch.randperm(32, generator=torch.Generator().manual_seed(0)).tolist()
    pos = 37
    with torch.inference_mode():
        model(torch.tensor(ids[:pos]), 0, block_table=table)  # prompt through the torch path
        pools = (kv.k_pool, kv.v_pool) + ((kv.k_scale_pool, kv.v_scale_pool) if kv.quantized else ())
        saved = [t.clone() for t in pools]
        assert model.enable_fused(cpu_gemv.library())
        fused = model(torch.tensor([ids[pos]]), pos, block_table=table)
        slot = torch.tensor([table[pos // 8] * 8 + pos % 8])
        written = [kv.read(layer, slot) for layer in range(kv.num_layers)]  # dequantized fp32
        for t, old in zip(pools, saved):
            t.copy_(old)
        model.fused = None
        plain = model(torch.tensor([ids[pos]]), pos, block_table=table)
        again = [kv.read(layer, slot) for layer in range(kv.num_layers)]
    assert torch.isfinite(fused).all()
    assert (fused - plain).abs().max().item() < tol
    # Rounded into the pool's dtype as torch rounds: the two differ by the fp32 difference of their
    # inputs (summation order) plus at most one rounding step of the stored dtype.
    rel = {"fp32": 0.0, "fp16": 2 ** -10, "bf16": 2 ** -7}
    for (ck, cv), (tk, tv) in zip(written, again):
        for a, b in ((ck, tk), (cv, tv)):
            assert torch.isfinite(a).all()
            step = (b.abs().amax(-1, keepdim=True) / 127 if kv_dtype == "int8" else b.abs() * rel[kv_dtype])
            assert ((a - b).abs() <= 2e-3 + 2.01 * step).all()


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16", "int8"])
def test_c_kv_store_rounds_exactly_as_torch_write(kv_dtype, build):
    """Both builds (F16C intrinsics; the portable one's software half conversion) round as torch does,
    and int8 rows are Hadamard-rotated with the same additions in the same order as torch's butterfly."""
    from kernels.kv_cache import PagedKVCache

    lib = cpu_gemv.library() if build == "native" else cpu_gemv.load_variant(cpu_gemv.SCALAR_FLAGS)
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-6, 4, 50).view(50, 1, 1)
    x[0, 0, :5] = torch.tensor([0.0, -0.0, 65519.0, 65520.0, 1e-8])  # fp16 edges: max, overflow, subnormal
    x[1, 1] = 0.0  # an all-zero int8 row (scale 0)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:50]
    a = PagedKVCache(1, 8, 8, 3, 64, kv_dtype)
    b = PagedKVCache(1, 8, 8, 3, 64, kv_dtype)
    a.write(0, slots, x, x)
    lib.kv_store_rows(b.k_pool.data_ptr(), b.k_scale_pool.data_ptr() if b.quantized else None, KV_KIND[kv_dtype],
                      int(b.rotated), slots.data_ptr(), 50, 3, 64, x.data_ptr())
    flat = lambda t: t.view(-1, 3, 64)[slots]
    assert torch.equal(flat(a.k_pool).view(torch.uint8), flat(b.k_pool).view(torch.uint8))
    if a.quantized:
        assert torch.equal(a.k_scale_pool.view(-1, 3)[slots], b.k_scale_pool.view(-1, 3)[slots])


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8"])
def test_batched_fused_step_rows_equal_single_steps_exactly(model_path, prose, kv_dtype):
    """The continuous-batching decode step: M tokens of M sequences (different lengths, scattered
    block tables) in one C call give, row for row, bit-identical logits to M one-token steps."""
    from edge_runtime.model.tokenizer import Tokenizer

    model, gf = load_model(model_path, quant="gguf")
    ids = Tokenizer.from_metadata(gf.metadata).encode(prose)
    model.allocate_cache(256, num_blocks=48, block_size=16, kv_dtype=kv_dtype)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [order[0:12], order[12:20], order[20:48]]
    lengths = [37, 5, 90]
    assert model.enable_fused(cpu_gemv.library())
    with torch.inference_mode():
        for table, n, off in zip(tables, lengths, (0, 7, 3)):
            model(torch.tensor(ids[off:off + n]), 0, block_table=table)
        nxt = [ids[40], ids[50], ids[95]]
        batched = model.fused.step_batch(nxt, lengths, tables)
        single = [model.fused.step(t, n, table) for t, n, table in zip(nxt, lengths, tables)]
        again = model.fused.step_batch(nxt[1:2], lengths[1:2], tables[1:2])
    assert batched.shape == (3, model.cfg.vocab_size)
    for row, one in enumerate(single):
        assert torch.equal(batched[row], one[0]), row
    assert torch.equal(again[0], single[1][0])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_drafts_sharing_attention_reads_equal_single_steps_exactly(model_path, prose, threads):
    """A token and its drafts (consecutive positions of one sequence, as the engine batches them) attend in
    one pass that reads each K/V row once for all of them; beside other sequences, and as a chunk of one
    sequence, every row's logits equal the one-token step at its position bit for bit, whatever the
    thread split (a pass may hold part of a KV head's query heads)."""
    from edge_runtime.model.tokenizer import Tokenizer

    model, gf = load_model(model_path, quant="gguf")
    ids = Tokenizer.from_metadata(gf.metadata).encode(prose)
    model.allocate_cache(256, num_blocks=48, block_size=16, kv_dtype="fp16")
    order = torch.randperm(48, generator=torch.Generator().manual_seed(2)).tolist()
    tables = {"a": order[0:12], "b": order[12:20], "c": order[20:48]}
    lengths = {"a": 37, "b": 5, "c": 90}
    rows = {"a": ids[100:104], "b": ids[104:105], "c": ids[105:107]}  # a token and 3, 0 and 1 drafts
    assert model.enable_fused(cpu_gemv.library())
    cpu_gemv.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for key, off in zip("abc", (0, 7, 3)):
                model(torch.tensor(ids[off:off + lengths[key]]), 0, block_table=tables[key])
            single = {key: torch.cat([model.fused.step(t, lengths[key] + i, tables[key])
                                      for i, t in enumerate(rows[key])]) for key in "abc"}
            order_rows = [(key, i) for key in "abc" for i in range(len(rows[key]))]
            batched = model.fused.step_batch([rows[k][i] for k, i in order_rows],
                                             [lengths[k] + i for k, i in order_rows],
                                             [tables[k] for k, _ in order_rows])
            chunk = model.fused.step_chunk(rows["a"], lengths["a"], tables["a"])
    finally:
        cpu_gemv.set_num_threads(0)
    for row, (key, i) in enumerate(order_rows):
        assert torch.equal(batched[row], single[key][i]), (key, i)
    assert torch.equal(chunk, single["a"])


@pytest.mark.parametrize("arith", ["int8", "exact"])
def test_step_does_not_depend_on_the_thread_count(model_path, prose, arith):
    """A step is one parallel region whose threads split every phase (GEMM rows, attention heads, SiLU
    ranges) and meet at spin barriers: 1, 2 and 3 threads (more than this machine's cores, so waiting
    threads must yield) give bit-identical logits, for one token and for a batch of 6 (x86's interleaved
    path for >= 5 rows)."""
    from edge_runtime.model.tokenizer import Tokenizer

    old_arith = cpu_gemv.arith()
    cpu_gemv.set_arith(arith)
    try:
        model, gf = load_model(model_path, quant="gguf")
        ids = Tokenizer.from_metadata(gf.metadata).encode(prose)
        model.allocate_cache(256, num_blocks=64, block_size=16, kv_dtype="fp16")
        tables = [list(range(10 * i, 10 * i + 10)) for i in range(6)]
        lengths = [30, 3, 47, 12, 64, 20]
        assert model.enable_fused(cpu_gemv.library())
        outs = []
        with torch.inference_mode():
            for table, n in zip(tables, lengths):
                model(torch.tensor(ids[:n]), 0, block_table=table)
            nxt = ids[70:76]
            for nt in (1, 2, 3):
                cpu_gemv.set_num_threads(nt)
                outs.append((model.fused.step(nxt[0], lengths[0], tables[0]),
                             model.fused.step_batch(nxt, lengths, tables)))
    finally:
        cpu_gemv.set_num_threads(0)
        cpu_gemv.set_arith(old_arith)
    for one, batch in outs[1:]:
        assert torch.equal(one, outs[0][0])
        assert torch.equal(batch, outs[0][1])
    assert torch.equal(outs[0][1][0], outs[0][0][0])  # row 0 of the batch is the one-token step


def test_rows_argmax_is_torch_argmax():
    """The engine's greedy tokens for a step come from one C call: the same index as torch.argmax on every
    row, ties (the first), NaN (the first NaN), all -inf and +inf rows included, at lengths around the
    8-lane vector width and at the vocabulary's."""
    from edge_runtime.model.fused_decode import FusedDecoder

    argmax = FusedDecoder.argmax.__get__(type("D", (), {"lib": cpu_gemv.library()})())
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 7, 8, 9, 15, 16, 17, 100, 49152):
        x = torch.randn(6, n, generator=g)
        x[1] = torch.randint(0, 3, (n,), generator=g).float()
        if n > 2:
            x[2, n // 2] = x[2, n - 1] = float("nan")
        x[3] = float("-inf")
        x[4, 0] = x[4, -1] = float("inf")
        x[5] = -x[5].abs() - 1.0
        assert argmax(x) == x.argmax(dim=-1).tolist(), n


def test_taps_leave_every_step_exact_and_report_the_tapped_layers(model_path, prose):
    """With `model.taps` the C step runs its layers in runs ending at each tapped layer: the logits and the
    final states stay bit for bit those of one call (one-token step, batch, chunk, draft tree), and the rows carry the
    residual stream after those layers, as the readable torch path computes it."""
    from edge_runtime.model.tokenizer import Tokenizer

    model, gf = load_model(model_path, quant="gguf")
    ids = Tokenizer.from_metadata(gf.metadata).encode(prose)[:60]
    dim, taps = model.cfg.dim, (3, 20)
    model.allocate_cache(128)
    assert model.enable_fused(cpu_gemv.library())

    def steps(with_taps):
        model.taps = with_taps
        with torch.inference_mode():
            model(torch.tensor(ids[:30]), 0)
            first = (model.last_hidden.clone(),)
            one = model.fused.step(ids[30], 30, model.identity_table), model.last_hidden.clone()
            chunk = model.fused.step_chunk(ids[31:40], 31, model.identity_table), model.fused.chunk_hidden.clone()
            batch = model.fused.step_batch([ids[40]], [40], [model.identity_table]), model.fused.batch_hidden.clone()
            tree = (model.fused.step_tree(ids[41:44], [-1, 0, 0], 41, [41, 42, 43], model.identity_table),
                    model.fused.chunk_hidden.clone())  # a draft tree: a root and two children
        return first + one + chunk + batch + tree

    plain, tapped = steps(()), steps(taps)
    for i in (1, 3, 5, 7):  # logits
        assert torch.equal(plain[i], tapped[i])
    for i in (0, 2, 4, 6, 8):  # the final states come first, then one dim per tap
        assert plain[i].shape[-1] == dim and tapped[i].shape[-1] == 3 * dim
        assert torch.equal(plain[i], tapped[i][..., :dim])
    cap = {}
    hooks = [model.blocks[t].register_forward_hook(lambda m, i, o, t=t: cap.__setitem__(t, o)) for t in taps]
    fused, model.fused, model.taps = model.fused, None, ()
    with torch.inference_mode():
        model(torch.tensor(ids[:40]), 0, all_logits=True)
    for h in hooks:
        h.remove()
    for j, t in enumerate(taps):  # the chunk's rows 31..39 against the torch path's block outputs
        c = tapped[4][:, (1 + j) * dim:(2 + j) * dim]
        assert torch.nn.functional.cosine_similarity(c, cap[t][31:40], dim=-1).min() > 0.99
    assert not torch.allclose(tapped[4][:, dim:2 * dim], tapped[4][:, 2 * dim:])  # two different layers
    model.fused, model.taps = fused, taps
    with torch.inference_mode():  # the torch path reports the same taps
        model.fused = None
        model(torch.tensor(ids[:30]), 0)
        assert torch.nn.functional.cosine_similarity(model.last_hidden[None], tapped[0][None]).item() > 0.99
