"""Does GRIFFIN's loss mask help the attention head? (a probe; docs/speculative.md, "Nor GRIFFIN's loss mask")

GRIFFIN (arXiv 2502.11018) trains a chain's later steps only where the draft was still aligned: step s's loss
counts at a start only where the model's greedy token was among the head's K best at every earlier step of
that chain (its code: K = 3). This runs `edge-runtime train-mtp --arch attention` on the first 2,040 written
prompts' answers (taps 20,26, one epoch, bf16: the probes' equal-data setting) with the soft loss wrapped in
that mask, K given as the first argument (0: the plain trainer, the baseline in the same code), and writes the
command's JSON and head to the path given as the second argument (+ .json, + .safetensors); with K > 0 it
prints the share of each step's targets the mask kept.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/griffin_mask_probe.py 3 .cache/probe-griffin3
"""
from __future__ import annotations

import sys

import torch

import edge_cli.mtp_data as mtp_data
import edge_cli.train_attn as train_attn
import edge_cli.train_mtp as train_mtp
from edge_cli.main import main

K, OUT = int(sys.argv[1]), sys.argv[2]
seen: dict = {}
plain_vocab, plain_loss, plain_load = train_attn.draft_vocab, train_mtp.soft_loss, mtp_data.load_shards


def draft_vocab(records, vocab_size, size):  # the trainer's draft index, kept to map targets to draft tokens
    vocab, index = plain_vocab(records, vocab_size, size)
    seen["index"] = index
    return vocab, index


def load_shards(*args, **kwargs):  # the data, kept for each flat row's greedy token
    seen["data"] = plain_load(*args, **kwargs)
    return seen["data"]


def greedy_rows() -> torch.Tensor:
    """Each flat row's greedy token as a draft index (-100 outside the draft vocabulary)."""
    if "greedy" not in seen:
        greedy = torch.full((len(seen["data"]["flat"]),), -100, dtype=torch.long)
        for r in seen["data"]["records"]:
            greedy[r["row"]:r["row"] + len(r["tokens"])] = seen["index"][r["greedy"]]
        seen["greedy"] = greedy
    return seen["greedy"]


def masked_loss(logits, states, idx, head_rows, weights):
    """The soft loss with step s kept where the greedy token was in the head's K best at steps 0..s-1."""
    if K:
        hard = greedy_rows()[idx.clamp(min=0)]
        hit = (logits.detach().topk(K, dim=-1).indices == hard[..., None]).any(-1).long()
        alive = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1].cumprod(-1)], dim=1).bool()
        seen["kept"] = seen.get("kept", 0) + (alive & (idx >= 0)).sum(0)
        seen["all"] = seen.get("all", 0) + (idx >= 0).sum(0)
        idx = torch.where(alive, idx, -1)
    return plain_loss(logits, states, idx, head_rows, weights)


train_attn.draft_vocab, train_mtp.soft_loss, mtp_data.load_shards = draft_vocab, masked_loss, load_shards
rc = main(["train-mtp", "--arch", "attention", "--prompt-set", "written", "--prompts", "2040", "--taps", "20,26",
           "--epochs", "1", "--precision", "bf16", "--threads", "2", "--json", OUT + ".json",
           "--out", OUT + ".safetensors"])
if K:
    print("share of each step's targets the mask kept:", [round(x, 3) for x in (seen["kept"] / seen["all"]).tolist()])
sys.exit(rc)
