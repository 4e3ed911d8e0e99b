"""Serving a built folder: its typed config, ONNX Runtime sessions, the generation loop and its caches, and the
other hosts (onnxruntime-genai, TensorRT) behind one protocol.

    folder    FolderConfig: aqua_config.json, typed and validated; the manifest of the folder's files
    session   ONNX Runtime sessions, the native kernel library, the serving memory checks
    lm        OrtLM: this project's loop over the graph contract
    caches    SharedCache / H2OCache: buffers bound as past and present, written in place by the graph
    sampling  SamplingConfig and the token pick shared by every host
    text      tokenizer loading, prompt encoding, streaming
    genai     onnxruntime-genai: the folder's genai files and a runner
    tensorrt  the TopKGatherDot plugin, engine build and runner
    hosts     open_lm: one of the above by name

onnxruntime, onnxruntime_genai and tensorrt are imported inside the functions that need them.
"""
