//! KV-event subscriber: turns engine ZMQ KV events into cache-state reports.
