#!/usr/bin/env python3
"""Reference generator for golden_vectors.json.

An independent implementation of the content fingerprint (XXH3-64, seed 1337,
little-endian u32 token ids per block, rolling little-endian chaining, 8-byte
big-endian wire form) written against the PyPI `xxhash` package. The Rust
`fingerprint` crate must reproduce every vector byte for byte.

Usage: generate.py [--check PATH | --out PATH]
"""

import argparse
import base64
import json
import struct
import sys

import xxhash

SEED = 1337


def content_hash(tokens):
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=SEED)


def chain(parent, content):
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, content), seed=SEED)


def fingerprint(tokens, block_size, parent=None):
    contents, prefixes = [], []
    previous = parent
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        c = content_hash(tokens[start : start + block_size])
        p = c if previous is None else chain(previous, c)
        contents.append(c)
        prefixes.append(p)
        previous = p
    return contents, prefixes


def b64(value):
    return base64.b64encode(struct.pack(">Q", value)).decode("ascii")


def vector(name, tokens, block_size, parent=None):
    contents, prefixes = fingerprint(tokens, block_size, parent)
    out = {"name": name, "tokens": tokens, "block_size": block_size}
    if parent is not None:
        out["parent"] = {"decimal": str(parent), "base64": b64(parent)}
    out["content_hashes"] = [{"decimal": str(c), "base64": b64(c)} for c in contents]
    out["prefix_hashes"] = [{"decimal": str(p), "base64": b64(p)} for p in prefixes]
    return out


def vectors():
    _, parent_prefixes = fingerprint(list(range(100, 132)), 16)
    return [
        vector("single_block_1_to_16", list(range(1, 17)), 16),
        vector("four_blocks_0_to_63", list(range(64)), 16),
        vector("partial_tail_dropped", list(range(1, 41)), 16),
        vector("multi_block_realistic_ids", [151644, 872, 198, 9707, 11, 1246, 525, 498] * 6, 16),
        vector("parent_chain", list(range(132, 164)), 16, parent=parent_prefixes[-1]),
        vector("shorter_than_one_block", [5, 6, 7], 16),
        vector("block_size_32", list(range(1000, 1096)), 32),
        vector("block_size_4", [9, 8, 7, 6, 5, 4, 3, 2, 1], 4),
        vector("token_ids_at_least_2_pow_31", [2**31, 2**31 + 1, 2**32 - 1, 4000000000] * 4, 16),
        vector("block_size_1", [42, 43, 44], 1),
    ]


def render():
    doc = {
        "description": "Content fingerprint golden vectors: XXH3-64 seed 1337 over little-endian u32 "
        "token ids per full block; prefix[0] = content[0] (or XXH3(le8(parent) ++ le8(content[0]))), "
        "prefix[i] = XXH3(le8(prefix[i-1]) ++ le8(content[i])); wire form is 8-byte big-endian. "
        "Hashes are given as decimal u64 strings and base64 of the big-endian bytes.",
        "seed": SEED,
        "vectors": vectors(),
    }
    return json.dumps(doc, indent=2) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", help="write the vectors to this path")
    group.add_argument("--check", help="fail unless this file equals freshly generated vectors")
    args = parser.parse_args()
    text = render()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        return 0
    with open(args.check, encoding="utf-8") as f:
        committed = f.read()
    if committed != text:
        sys.stderr.write(f"{args.check} differs from the reference generator's output; "
                         "regenerate with golden/generate.py --out and review the diff\n")
        return 1
    print(f"{args.check}: matches the reference generator ({len(vectors())} vectors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
