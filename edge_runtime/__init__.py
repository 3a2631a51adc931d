"""The device side: model, engine, speculative decoding, hybrid runtime, backends, gateway (see DESIGN.md)."""
import os

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # shipped data files
