#!/usr/bin/env python3
"""A stand-in vLLM KV-event publisher for the subscriber tests.

Emits byte-exact vLLM KV-event batches: multipart ``[topic, seq (8-byte
big-endian), msgpack payload]`` on a PUB-compatible socket, with the payload
``[ts, events, data_parallel_rank?]`` and events either as tagged arrays
(vLLM <= 0.23) or as maps with a "type" key (vLLM >= 0.24). Like the engine's
msgspec encoder it omits a trailing field left at its default (the batch's
data_parallel_rank, an event's lora_name). It answers replay requests on a
ROUTER socket: a request carries the start sequence as 8 bytes big-endian;
the replies are ``[seq, payload]`` (vLLM <= 0.25) or ``[topic, seq, payload]``
(>= 0.26), ended by seq = -1.

Two modes:

  kv_publisher.py serve [--replay-format v25|v26]
      Binds PUB (an XPUB, so it can report subscriptions) and ROUTER on
      127.0.0.1 ephemeral ports, prints {"pub": ..., "replay": ...} on its
      first stdout line, then executes one JSON command per stdin line and
      answers each with one JSON line. Commands:
        {"op": "wait_subscriber", "count": 1, "timeout": 10}
        {"op": "publish", "events": [...], "layout": "array"|"map",
         "send": true, "dp_rank": null}        -> {"ok": true, "seq": n}
        {"op": "raw", "frames_hex": ["..", ..]} -> sends arbitrary frames
        {"op": "set_seq", "seq": n}             -> next sequence number
        {"op": "prepare", "batches": n, "events_per_batch": e,
         "blocks_per_event": b}                 -> pre-encodes benchmark batches
        {"op": "blast"}                         -> sends the prepared batches back
                                                   to back (benchmark load)
        {"op": "quit"}
      An event is {"type": "BlockStored", "block_hashes": [...],
      "parent_block_hash": h|null, "token_ids": [...], "block_size": 16,
      "lora_id": null, "medium": "GPU", "lora_name": null} /
      {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"} /
      {"type": "AllBlocksCleared"}; a hash is an int (signed or unsigned) or
      {"hex": "..."} for the bytes form. Cache salts:
        "vllm_extra_keys": [entry, ...]  vLLM's `extra_keys` (>= 0.18), one
            entry per block, null or a list of items: strings (LoRA name,
            salt), lists (multimodal (identifier, offset) pairs) and
            {"hex": ...} (prompt-embeds digests as bytes); array item 8 (with
            `lora_name` kept in place) or the map key `extra_keys`.
        "sglang_cache_salt": "..."  SGLang's salt: in the array layout the
            {"cache_salt": ...} map 0.5.18-0.5.19 append after the fields, in
            the map layout (0.5.20+) the `cache_salt` key.

  kv_publisher.py fixtures DIR
      Writes the payload fixtures the Rust decoder unit tests read.
"""

import json
import struct
import sys
import threading
import time

import msgpack

TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _hash(value):
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"])
    return value


def _extra_item(value):
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"])
    if isinstance(value, list):
        return [_extra_item(v) for v in value]
    return value


def _extra_keys(event):
    return [None if entry is None else [_extra_item(v) for v in entry]
            for entry in event["vllm_extra_keys"]]


def event_fields(event):
    """Field values of an event in declaration order, with their defaults."""
    kind = event["type"]
    if kind == "BlockStored":
        parent = event.get("parent_block_hash")
        return kind, [
            ("block_hashes", [_hash(h) for h in event["block_hashes"]], None),
            ("parent_block_hash", None if parent is None else _hash(parent), None),
            ("token_ids", list(event["token_ids"]), None),
            ("block_size", event["block_size"], None),
            ("lora_id", event.get("lora_id"), None),
            ("medium", event.get("medium", "GPU"), None),
            ("lora_name", event.get("lora_name"), "default-none"),
        ]
    if kind == "BlockRemoved":
        return kind, [
            ("block_hashes", [_hash(h) for h in event["block_hashes"]], None),
            ("medium", event.get("medium", "GPU"), None),
        ]
    if kind == "AllBlocksCleared":
        return kind, []
    raise ValueError(f"unknown event type {kind!r}")


def encode_event(event, layout):
    kind, fields = event_fields(event)
    # msgspec omit_defaults: a defaulted field equal to its default is left out
    # (for array_like structs only when trailing).
    if layout == "array":
        if "vllm_extra_keys" in event:
            fields.append(("extra_keys", _extra_keys(event), None))
        while fields and fields[-1][2] == "default-none" and fields[-1][1] is None:
            fields.pop()
        out = [kind] + [value for _, value, _ in fields]
        if "sglang_cache_salt" in event:
            out.append({"cache_salt": event["sglang_cache_salt"]})
        out.extend(event.get("extra_fields", []))
        return out
    if layout == "map":
        out = {"type": kind}
        for name, value, default in fields:
            if default == "default-none" and value is None:
                continue
            out[name] = value
        if "vllm_extra_keys" in event:
            out["extra_keys"] = _extra_keys(event)
        if "sglang_cache_salt" in event:
            out["cache_salt"] = event["sglang_cache_salt"]
        out.update(event.get("extra_keys", {}))
        return out
    raise ValueError(f"unknown layout {layout!r}")


def encode_batch(events, layout="array", dp_rank=None, ts=1700000000.25):
    batch = [ts, [encode_event(e, layout) for e in events]]
    if dp_rank is not None:
        batch.append(dp_rank)
    return msgpack.packb(batch, use_bin_type=True)


def serve(replay_format):
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:*")
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    buffer = []  # (seq, payload)
    lock = threading.Lock()
    state = {"next_seq": 0, "subscriptions": 0, "stop": False}

    def replay_loop():
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not state["stop"]:
            if not poller.poll(100):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with lock:
                items = [(s, p) for s, p in buffer if s >= start_seq]
            for seq, payload in items:
                body = [seq.to_bytes(8, "big"), payload]
                if replay_format == "v26":
                    body.insert(0, TOPIC)
                router.send_multipart([client, b""] + body)
            end = [END_SEQ, b""]
            if replay_format == "v26":
                end.insert(0, TOPIC)
            router.send_multipart([client, b""] + end)

    thread = threading.Thread(target=replay_loop, daemon=True)
    thread.start()

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({
        "pub": pub.getsockopt_string(zmq.LAST_ENDPOINT),
        "replay": router.getsockopt_string(zmq.LAST_ENDPOINT),
    })

    def drain_subscriptions(timeout_ms):
        if pub.poll(timeout_ms, zmq.POLLIN):
            while True:
                try:
                    msg = pub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if msg[:1] == b"\x01":
                    state["subscriptions"] += 1

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "wait_subscriber":
                deadline = time.monotonic() + cmd.get("timeout", 10)
                want = cmd.get("count", 1)
                while state["subscriptions"] < want and time.monotonic() < deadline:
                    drain_subscriptions(50)
                ok = state["subscriptions"] >= want
                reply({"ok": ok, "subscriptions": state["subscriptions"]})
            elif op == "publish":
                drain_subscriptions(0)
                payload = encode_batch(
                    cmd["events"], cmd.get("layout", "array"), cmd.get("dp_rank")
                )
                with lock:
                    seq = state["next_seq"]
                    state["next_seq"] += 1
                    buffer.append((seq, payload))
                    del buffer[:-10000]
                if cmd.get("send", True):
                    pub.send_multipart([TOPIC, struct.pack(">Q", seq), payload])
                reply({"ok": True, "seq": seq})
            elif op == "raw":
                pub.send_multipart([bytes.fromhex(f) for f in cmd["frames_hex"]])
                reply({"ok": True})
            elif op == "set_seq":
                with lock:
                    state["next_seq"] = cmd["seq"]
                    buffer.clear()
                reply({"ok": True})
            elif op == "prepare":
                state["prepared"] = blast_payloads(
                    cmd["batches"], cmd["events_per_batch"], cmd["blocks_per_event"],
                    cmd.get("block_size", 16), cmd.get("layout", "array"), cmd.get("first_hash", 1),
                )
                reply({"ok": True, "batches": len(state["prepared"])})
            elif op == "blast":
                payloads = state.pop("prepared", [])
                start = time.perf_counter()
                with lock:
                    first_seq = state["next_seq"]
                    state["next_seq"] += len(payloads)
                for i, payload in enumerate(payloads):
                    pub.send_multipart([TOPIC, struct.pack(">Q", first_seq + i), payload])
                reply({"ok": True, "send_seconds": time.perf_counter() - start,
                       "bytes": sum(len(p) for p in payloads)})
            elif op == "quit":
                reply({"ok": True})
                break
            else:
                reply({"ok": False, "error": f"unknown op {op}"})
        except Exception as exc:  # report, keep serving
            reply({"ok": False, "error": repr(exc)})
    state["stop"] = True
    thread.join()
    pub.close(0)
    router.close(0)
    ctx.term()


def blast_payloads(batches, events_per_batch, blocks_per_event, block_size, layout, first_hash):
    """Pre-encoded batches of distinct fresh chains (one chain per event)."""
    payloads = []
    next_hash = first_hash
    for b in range(batches):
        events = []
        for e in range(events_per_batch):
            base = (b * events_per_batch + e) * blocks_per_event * block_size
            hashes = list(range(next_hash, next_hash + blocks_per_event))
            next_hash += blocks_per_event
            events.append({
                "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": list(range(base, base + blocks_per_event * block_size)),
                "block_size": block_size, "lora_id": None, "medium": "GPU",
            })
        payloads.append(encode_batch(events, layout))
    return payloads


# Payload fixtures for the decoder unit tests: (file name, events, layout, dp_rank).
TOKENS_32 = list(range(1, 33))
FIXTURES = [
    ("array_stored_int.msgpack", [
        {"type": "BlockStored", "block_hashes": [1001, 1002], "parent_block_hash": None,
         "token_ids": TOKENS_32, "block_size": 16, "lora_id": None, "medium": "GPU"},
    ], "array", None),
    ("array_stored_signed_parent.msgpack", [
        {"type": "BlockStored", "block_hashes": [-5, 18446744073709551615],
         "parent_block_hash": -1, "token_ids": TOKENS_32, "block_size": 16,
         "lora_id": 2, "medium": "CPU", "lora_name": "sql-lora"},
    ], "array", 1),
    ("array_mixed_trailing.msgpack", [
        {"type": "BlockStored", "block_hashes": [{"hex": "ab" * 32}], "parent_block_hash": None,
         "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": None,
         "lora_name": "x", "extra_fields": [42, "future"]},
        {"type": "BlockRemoved", "block_hashes": [{"hex": "ab" * 32}], "medium": "GPU",
         "extra_fields": [None]},
        {"type": "AllBlocksCleared", "extra_fields": [1]},
        {"type": "SomethingNew"},
    ], "array", None),
    ("map_stored_removed.msgpack", [
        {"type": "BlockStored", "block_hashes": [1001, 1002], "parent_block_hash": 7,
         "token_ids": TOKENS_32, "block_size": 16, "lora_id": 1, "medium": "GPU",
         "lora_name": "chat-lora", "extra_keys": {"group_idx": 0, "future": [1, 2]}},
        {"type": "BlockRemoved", "block_hashes": [1001], "medium": "cpu"},
        {"type": "AllBlocksCleared"},
    ], "map", 0),
]


def write_fixtures(directory):
    import os

    os.makedirs(directory, exist_ok=True)
    for name, events, layout, dp_rank in FIXTURES:
        unknown = [e for e in events if e["type"] not in
                   ("BlockStored", "BlockRemoved", "AllBlocksCleared")]
        known = [e for e in events if e not in unknown]
        payload = msgpack.unpackb(encode_batch(known, layout, dp_rank), raw=False,
                                  strict_map_key=False)
        for e in unknown:
            payload[1].append([e["type"]] if layout == "array" else {"type": e["type"]})
        data = msgpack.packb(payload, use_bin_type=True)
        with open(os.path.join(directory, name), "wb") as fh:
            fh.write(data)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "serve":
        fmt = "v25"
        if "--replay-format" in sys.argv:
            fmt = sys.argv[sys.argv.index("--replay-format") + 1]
        serve(fmt)
    elif len(sys.argv) == 3 and sys.argv[1] == "fixtures":
        write_fixtures(sys.argv[2])
    else:
        sys.stderr.write(__doc__)
        sys.exit(2)
