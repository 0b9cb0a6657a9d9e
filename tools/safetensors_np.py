"""A minimal safetensors writer for the Python tools (numpy only, so CI can use it without torch)."""
import json
import struct

import numpy as np


def write_safetensors(path, tensors):
    """tensors: name -> (safetensors dtype string, numpy array already in that dtype's byte layout).
    The header is padded to 8 bytes, as the reference writer does."""
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
