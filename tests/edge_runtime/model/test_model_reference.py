"""The native fp32 reference path against transformers loading the same GGUF in fp32.

Both dequantize the same file, so greedy tokens must be identical and logits
agree to 1e-3.
"""
import os

import pytest
import torch

from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.model.loader import load_model
from edge_runtime.model.tokenizer import Tokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a child.",
    "List three uses of copper.",
    "Translate 'good morning' into Spanish and German.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def reference(model_path):
    model, gf = load_model(model_path, quant="fp32")
    model.allocate_cache(512)
    return model, Tokenizer.from_metadata(gf.metadata), ChatTemplate.from_metadata(gf.metadata)


@pytest.fixture(scope="module")
def hf_model(model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), torch_dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fp32_greedy_tokens_and_logits_match_transformers(reference, hf_model, prompt):
    model, tok, tpl = reference
    ids = tok.encode(tpl.render([{"role": "user", "content": prompt}]), special=True)
    # Teacher-force the native greedy continuation through transformers in one pass.
    ours, logits = [], []
    with torch.inference_mode():
        lg = model(torch.tensor(ids), 0)[-1]
        pos = len(ids)
        for _ in range(NEW_TOKENS):
            logits.append(lg)
            nxt = int(lg.argmax())
            ours.append(nxt)
            lg = model(torch.tensor([nxt]), pos)[-1]
            pos += 1
        hf_logits = hf_model(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1]
    ours_logits = torch.stack(logits)
    assert hf_logits.argmax(-1).tolist() == ours  # identical greedy tokens, all 64
    assert (hf_logits - ours_logits).abs().max().item() <= 1e-3
