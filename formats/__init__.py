"""File formats both the compiler and the runtime read: the engine file and its manifest, ONNX I/O
past 2 GB, the decoder interface and onnxruntime sessions. Nothing here imports the compiler,
the passes or the runtime."""
