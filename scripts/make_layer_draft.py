#!/usr/bin/env python
"""Write a draft model made of a model's first N layers (its embeddings, those layers, its final
norm and output head, its vocabulary: llama.cpp's "early exit" without training). The default
model has no smaller sibling with its vocabulary, so this is the draft the benchmarks can use.

    python scripts/make_layer_draft.py --layers 6 [--model NAME] [-o out.gguf]

Prints the path written (by default beside the model, "<stem>-first<N>.gguf").
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf

from llamabatch.catalog import Catalog


def first_layers(source: Path, target: Path, n_layers: int) -> Path:
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        value = n_layers if key == f"{arch}.block_count" else field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    for tensor in reader.tensors:
        layer = re.match(r"blk\.(\d+)\.", tensor.name)
        if layer and int(layer[1]) >= n_layers:
            continue
        # Quantized tensors are copied as they are stored (the reader gives them as rows of bytes).
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--model")
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    source = Catalog.load().resolve(args.model).gguf_path()
    target = args.output or source.with_name(f"{source.stem}-first{args.layers}.gguf")
    print(first_layers(source, target, args.layers))


if __name__ == "__main__":
    main()
