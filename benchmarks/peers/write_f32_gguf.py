"""Write an F32 copy of a GGUF file: same metadata and tokenizer, every tensor dequantized.

    .venv/bin/python -m benchmarks.peers.write_f32_gguf SRC.gguf DST.gguf

llama.cpp then runs the model on the same weights slotserve computes with (fp32), so the
peer comparison is not also a comparison of quantizations. Tensors keep llama.cpp's layout
(its Q/K row order included): they are dequantized, not converted.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from slotserve.loader.gguf import dequantize, read_gguf

SKIP_KEYS = {"general.file_type"}


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in SKIP_KEYS or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def main(src: str, dst: str) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    copy_metadata(reader, writer)
    _, tensors = read_gguf(src)
    for tensor in tensors:
        values = dequantize(tensor.data, tensor.tensor_type).numpy()
        rows = tuple(reversed(tensor.shape))  # numpy order: (ne1, ne0)
        writer.add_tensor(tensor.name, np.ascontiguousarray(values.reshape(rows)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="the GGUF file to copy (any quantization)")
    p.add_argument("dst", help="where to write the F32 copy")
    args = p.parse_args()
    main(args.src, args.dst)
