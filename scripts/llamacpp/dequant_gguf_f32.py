#!/usr/bin/env python3
"""Write an all-F32 copy of a GGUF: every tensor dequantized exactly (gguf-py), metadata copied.

Running llama.cpp on this copy with flash attention off and an f32 KV cache gives float32
math on exactly the Q4_1/Q8_0 weight values, without llama.cpp's Q8 activation
quantization: the "exact" reference in the fixtures. Calibration only, not committed output.

Usage: PYTHONPATH=<llama.cpp>/gguf-py dequant_gguf_f32.py IN.gguf OUT.gguf
"""
import sys
import numpy as np
import gguf
src, dst = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(src)
arch = r.fields['general.architecture'].contents()
w = gguf.GGUFWriter(dst, arch)
for f in r.fields.values():
    if f.name == 'general.architecture' or f.name.startswith('GGUF.'):
        continue
    vt = f.types[0]
    st = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
    if f.name == 'general.file_type':
        w.add_key_value(f.name, 0, vt)  # ALL_F32
        continue
    w.add_key_value(f.name, f.contents(), vt, sub_type=st)
for t in r.tensors:
    a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    a = a.reshape([int(x) for x in reversed(t.shape.tolist())])
    w.add_tensor(t.name, a, raw_dtype=gguf.GGMLQuantizationType.F32)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
