"""ONNX export of the model and its weights, for the onnxruntime backend."""
