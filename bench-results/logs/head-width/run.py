"""Probe of the MLP heads' width (issue 18): the chat-like probe's data (../chat-data-small, 178,176 answer tokens,
`.cache/mtp-chat.pt` from its `run.py gen`), the same trainer (soft loss, 4 epochs, no taps) at SwiGLU width
HIDDEN, measured on MT-Bench's 80 first turns replayed at k = 3 alone and with prompt lookup. Width 1024 (the
shipped heads' width) gave 1.518 and 1.841 there. Run from the repo root:
.venv/bin/python bench-results/logs/head-width/run.py HIDDEN"""
import importlib.util
import os
import sys

import torch

spec = importlib.util.spec_from_file_location("chat_probe", os.path.join(os.path.dirname(__file__), "..",
                                                                          "chat-data-small", "run.py"))
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
hidden = int(sys.argv[1])
probe.train_and_measure(probe.backend_for_probes(), torch.load(".cache/mtp-chat.pt"), f"chat-hidden{hidden}", hidden)
