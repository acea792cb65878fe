//! One simulated replica: its prefix-block cache and its serving-time model.
//!
//! Serving model: prefill is FIFO, one request at a time, at `prefill_tps`
//! tokens per second over the request's *uncached* tokens; decode runs in
//! parallel with everything (it never delays a prefill) at `tpot` per output
//! token. So a request arriving at `t` starts prefill at
//! `max(t, end of the previous prefill)`, and its TTFT is that wait plus its
//! own uncached prefill time. A request is *waiting* from arrival to the end
//! of its prefill and *running* from there to the end of its decode; the KV
//! cache in use is the blocks of waiting and running requests over the
//! capacity (cached but idle blocks count as free, as in vLLM).
//!
//! Times are `f64` milliseconds of simulated time; `advance` must be called
//! with non-decreasing times. Costs: O(1) amortized per request, plus a heap
//! operation per decode end.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::lru::BlockLru;

/// Serving-time parameters shared by every replica.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServingModel {
    /// Prefill throughput, tokens per second.
    pub prefill_tps: f64,
    /// Decode time per output token, milliseconds.
    pub tpot_ms: f64,
}

impl ServingModel {
    /// Milliseconds to prefill `tokens`.
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        tokens as f64 * 1000.0 / self.prefill_tps
    }
}

/// Load figures of one replica at one instant, as an engine would report them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Requests queued or in prefill.
    pub waiting: u32,
    /// Requests decoding.
    pub running: u32,
    /// Blocks of waiting and running requests over the cache capacity, in [0, 1].
    pub kv_usage: f32,
    /// `max(kv_usage, waiting / (waiting + running + 1))`, in [0, 1].
    pub pressure: f32,
    /// Token hit rate of every request served so far, in [0, 1].
    pub hit_rate: f32,
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    prefill_end_ms: f64,
    decode_end_ms: f64,
    blocks: u64,
}

/// A replica: LRU block cache, FIFO prefill queue, decode set and counters.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Prefix blocks held.
    pub cache: BlockLru,
    capacity_blocks: usize,
    busy_until_ms: f64,
    prefilling: VecDeque<InFlight>,
    prefilling_blocks: u64,
    decoding: BinaryHeap<Reverse<(u64, u64)>>,
    decoding_blocks: u64,
    /// Requests routed here.
    pub requests: u64,
    /// Uncached tokens prefilled here.
    pub prefill_tokens: u64,
    hit_tokens: u64,
    prompt_tokens: u64,
}

impl Replica {
    /// An idle replica with an empty cache of `capacity_blocks`.
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            cache: BlockLru::new(capacity_blocks),
            capacity_blocks,
            busy_until_ms: 0.0,
            prefilling: VecDeque::new(),
            prefilling_blocks: 0,
            decoding: BinaryHeap::new(),
            decoding_blocks: 0,
            requests: 0,
            prefill_tokens: 0,
            hit_tokens: 0,
            prompt_tokens: 0,
        }
    }

    /// Moves finished prefills to decode and drops finished decodes, up to `now_ms`.
    pub fn advance(&mut self, now_ms: f64) {
        while let Some(front) = self.prefilling.front().copied() {
            if front.prefill_end_ms > now_ms {
                break;
            }
            self.prefilling.pop_front();
            self.prefilling_blocks -= front.blocks;
            if front.decode_end_ms > now_ms {
                self.decoding
                    .push(Reverse((micros(front.decode_end_ms), front.blocks)));
                self.decoding_blocks += front.blocks;
            }
        }
        let now_us = micros(now_ms);
        while let Some(&Reverse((end_us, blocks))) = self.decoding.peek() {
            if end_us > now_us {
                break;
            }
            self.decoding.pop();
            self.decoding_blocks -= blocks;
        }
    }

    /// Prefill tokens still queued at `now_ms` (including the unfinished part
    /// of the request in prefill).
    pub fn queued_prefill_tokens(&self, now_ms: f64, model: &ServingModel) -> f64 {
        (self.busy_until_ms - now_ms).max(0.0) * model.prefill_tps / 1000.0
    }

    /// Queues a request arriving at `now_ms` with `uncached` tokens to prefill;
    /// returns its TTFT in milliseconds.
    pub fn serve(&mut self, now_ms: f64, request: Served, model: &ServingModel) -> f64 {
        let start = self.busy_until_ms.max(now_ms);
        let prefill_end_ms = start + model.prefill_ms(request.uncached_tokens);
        self.busy_until_ms = prefill_end_ms;
        let decode_end_ms = prefill_end_ms + f64::from(request.output_tokens) * model.tpot_ms;
        self.prefilling.push_back(InFlight {
            prefill_end_ms,
            decode_end_ms,
            blocks: request.blocks,
        });
        self.prefilling_blocks += request.blocks;
        self.requests += 1;
        self.prefill_tokens += request.uncached_tokens;
        self.hit_tokens += request.prompt_tokens - request.uncached_tokens;
        self.prompt_tokens += request.prompt_tokens;
        prefill_end_ms - now_ms
    }

    /// When the last queued prefill ends (the replica's FIFO drains), milliseconds.
    pub fn prefill_end_ms(&self) -> f64 {
        self.busy_until_ms
    }

    /// Load as of the last `advance`.
    pub fn load(&self) -> Load {
        let waiting = self.prefilling.len() as u32;
        let running = self.decoding.len() as u32;
        let kv_usage = if self.capacity_blocks == 0 {
            1.0
        } else {
            ((self.prefilling_blocks + self.decoding_blocks) as f64 / self.capacity_blocks as f64)
                .min(1.0) as f32
        };
        let queue_share = waiting as f32 / (waiting + running + 1) as f32;
        let hit_rate = if self.prompt_tokens == 0 {
            0.0
        } else {
            (self.hit_tokens as f64 / self.prompt_tokens as f64) as f32
        };
        Load {
            waiting,
            running,
            kv_usage,
            pressure: kv_usage.max(queue_share),
            hit_rate,
        }
    }
}

/// What a served request costs its replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens not in the cache.
    pub uncached_tokens: u64,
    /// Tokens to generate.
    pub output_tokens: u32,
    /// Prompt blocks (held in the KV cache while the request is in flight).
    pub blocks: u64,
}

fn micros(ms: f64) -> u64 {
    (ms * 1000.0).round().max(0.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: ServingModel = ServingModel {
        prefill_tps: 1000.0,
        tpot_ms: 10.0,
    };

    fn served(prompt: u64, uncached: u64, output: u32) -> Served {
        Served {
            prompt_tokens: prompt,
            uncached_tokens: uncached,
            output_tokens: output,
            blocks: 2,
        }
    }

    #[test]
    fn fifo_prefill_queues_behind_earlier_requests() {
        let mut replica = Replica::new(8);
        // 500 uncached tokens at 1000 tok/s: 500 ms.
        assert_eq!(replica.serve(0.0, served(600, 500, 10), &MODEL), 500.0);
        // Arrives at 100 ms, waits 400 ms, prefills 200 ms.
        assert_eq!(replica.serve(100.0, served(200, 200, 10), &MODEL), 600.0);
        replica.advance(100.0);
        assert_eq!(replica.queued_prefill_tokens(100.0, &MODEL), 600.0);
        let load = replica.load();
        assert_eq!((load.waiting, load.running), (2, 0));
        assert_eq!(load.kv_usage, 0.5);
        assert_eq!(load.pressure, 2.0 / 3.0);
        // At 550 ms the first request decodes (until 600 ms), the second prefills.
        replica.advance(550.0);
        let load = replica.load();
        assert_eq!((load.waiting, load.running), (1, 1));
        replica.advance(2000.0);
        let load = replica.load();
        assert_eq!((load.waiting, load.running), (0, 0));
        assert_eq!(load.kv_usage, 0.0);
        assert_eq!(load.hit_rate, 100.0 / 800.0);
        // Idle again: no wait.
        assert_eq!(replica.serve(2000.0, served(100, 0, 1), &MODEL), 0.0);
        assert_eq!((replica.requests, replica.prefill_tokens), (3, 700));
    }
}
