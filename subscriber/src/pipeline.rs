//! The hand-off between the ZMQ readers and the gRPC reporter.
//!
//! Readers decode frames without any lock, then apply the decoded events to
//! their endpoint's [`BlockTracker`] and append the resulting actions to one
//! bounded buffer, both under a single short-held mutex (so the tracked
//! state and the buffer can be captured together for a resync). The reporter
//! takes work out in batches. When the buffer is full the oldest actions are
//! dropped (counted) and a resync is requested: the next time the server is
//! reachable the reporter re-sends the whole tracked state instead of the
//! lost deltas.
//!
//! Cost: a lock per batch, not per event; the buffer is a `VecDeque` whose
//! capacity is counted in blocks (an action's weight).

use std::collections::VecDeque;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::event::EventBatch;
use crate::metrics::Metrics;
use crate::tracker::{Action, BlockTracker, TrackerOptions};

/// What the reporter should send next.
#[derive(Debug)]
pub(crate) enum Work {
    /// Deltas in event order.
    Actions(Vec<Action>),
    /// The whole tracked state: `Clear` followed by stores of every held block.
    Resync(Vec<Action>),
}

#[derive(Debug)]
struct Inner {
    trackers: Vec<BlockTracker>,
    queue: VecDeque<Action>,
    queued_weight: usize,
    resync_requested: bool,
    scratch: Vec<Action>,
}

/// Shared state of one subscriber.
#[derive(Debug)]
pub(crate) struct Pipeline {
    inner: Mutex<Inner>,
    wake: Notify,
    capacity: usize,
}

impl Pipeline {
    /// One tracker per endpoint; `capacity` pending blocks/events.
    pub(crate) fn new(endpoints: usize, options: &TrackerOptions, capacity: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                trackers: (0..endpoints)
                    .map(|_| BlockTracker::new(options.clone()))
                    .collect(),
                queue: VecDeque::new(),
                queued_weight: 0,
                resync_requested: false,
                scratch: Vec::new(),
            }),
            wake: Notify::new(),
            capacity,
        }
    }

    /// Applies one decoded batch from endpoint `endpoint`.
    pub(crate) fn apply_batch(&self, endpoint: usize, batch: EventBatch, metrics: &Metrics) {
        metrics.events_skipped.inc_by(batch.skipped_events as u64);
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let mut actions = std::mem::take(&mut inner.scratch);
        let mut cleared = false;
        if let Some(tracker) = inner.trackers.get_mut(endpoint) {
            for event in batch.events {
                tracker.apply(event, metrics, &mut actions);
            }
            cleared = actions.iter().any(|a| matches!(a, Action::Clear));
        }
        for action in actions.drain(..) {
            Self::push(inner, action, self.capacity, metrics);
        }
        if cleared {
            // A clear empties the whole replica on the server: re-add what the
            // other endpoints (data-parallel ranks) still hold.
            Self::restore_others(inner, endpoint, self.capacity, metrics);
        }
        inner.scratch = actions;
        Self::update_gauges(inner, metrics);
        drop(guard);
        self.wake.notify_one();
    }

    /// The publisher at `endpoint` restarted: its cache is empty.
    pub(crate) fn reset_endpoint(&self, endpoint: usize, metrics: &Metrics) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if let Some(tracker) = inner.trackers.get_mut(endpoint) {
            tracker.reset();
        }
        Self::push(inner, Action::Clear, self.capacity, metrics);
        Self::restore_others(inner, endpoint, self.capacity, metrics);
        Self::update_gauges(inner, metrics);
        drop(guard);
        self.wake.notify_one();
    }

    /// Asks for a full re-report at the next opportunity.
    pub(crate) fn request_resync(&self) {
        self.inner.lock().resync_requested = true;
        self.wake.notify_one();
    }

    /// Takes pending work without waiting: a resync when one was requested,
    /// else up to about `max_weight` blocks of deltas, else `None`.
    pub(crate) fn try_take(&self, max_weight: usize, metrics: &Metrics) -> Option<Work> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if inner.resync_requested {
            inner.resync_requested = false;
            inner.queue.clear();
            inner.queued_weight = 0;
            let mut actions = vec![Action::Clear];
            for tracker in &inner.trackers {
                tracker.snapshot(&mut actions);
            }
            Self::update_gauges(inner, metrics);
            return Some(Work::Resync(actions));
        }
        if inner.queue.is_empty() {
            return None;
        }
        let mut taken = Vec::new();
        let mut weight = 0;
        while let Some(action) = inner.queue.pop_front() {
            weight += action.weight();
            taken.push(action);
            if weight >= max_weight {
                break;
            }
        }
        inner.queued_weight = inner.queued_weight.saturating_sub(weight);
        Self::update_gauges(inner, metrics);
        Some(Work::Actions(taken))
    }

    /// Stores of every block still held, leaving pending work in place (a
    /// periodic refresh: the deltas queued before it stay correct after it).
    pub(crate) fn snapshot(&self) -> Vec<Action> {
        let inner = self.inner.lock();
        let mut actions = Vec::new();
        for tracker in &inner.trackers {
            tracker.snapshot(&mut actions);
        }
        actions
    }

    /// Waits until work may be available (or a wake-up is forced).
    pub(crate) async fn wait(&self) {
        self.wake.notified().await;
    }

    fn push(inner: &mut Inner, action: Action, capacity: usize, metrics: &Metrics) {
        let weight = action.weight();
        while inner.queued_weight + weight > capacity {
            let Some(oldest) = inner.queue.pop_front() else {
                break;
            };
            let dropped = oldest.weight();
            inner.queued_weight = inner.queued_weight.saturating_sub(dropped);
            metrics.buffer_dropped.inc_by(dropped as u64);
            inner.resync_requested = true;
        }
        inner.queued_weight += weight;
        inner.queue.push_back(action);
    }

    fn restore_others(inner: &mut Inner, endpoint: usize, capacity: usize, metrics: &Metrics) {
        if inner.trackers.len() < 2 {
            return;
        }
        let mut stores = Vec::new();
        for (index, tracker) in inner.trackers.iter().enumerate() {
            if index != endpoint {
                tracker.snapshot(&mut stores);
            }
        }
        for action in stores {
            Self::push(inner, action, capacity, metrics);
        }
    }

    fn update_gauges(inner: &Inner, metrics: &Metrics) {
        metrics.buffer_items.set(inner.queued_weight as i64);
        let tracked: usize = inner.trackers.iter().map(BlockTracker::len).sum();
        metrics.tracked_blocks.set(tracked as i64);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::event::{BlockStored, EngineHash, KvEvent};

    fn options() -> TrackerOptions {
        TrackerOptions {
            block_size: 4,
            offload_tier: false,
            lora_names: HashMap::new(),
            capacity: 100,
        }
    }

    fn batch(first_hash: u64, blocks: u64) -> EventBatch {
        EventBatch {
            events: vec![KvEvent::Stored(BlockStored {
                block_hashes: (first_hash..first_hash + blocks)
                    .map(EngineHash::Int)
                    .collect(),
                token_ids: (0..blocks as u32 * 4)
                    .map(|t| t + first_hash as u32)
                    .collect(),
                block_size: 4,
                ..Default::default()
            })],
            ..Default::default()
        }
    }

    #[test]
    fn overflow_drops_oldest_and_requests_a_resync() {
        let metrics = Metrics::new();
        let pipeline = Pipeline::new(1, &options(), 5);
        pipeline.apply_batch(0, batch(0, 3), &metrics);
        pipeline.apply_batch(0, batch(10, 3), &metrics);
        assert_eq!(metrics.buffer_dropped.get(), 3);
        match pipeline.try_take(100, &metrics) {
            Some(Work::Resync(actions)) => {
                assert_eq!(actions[0], Action::Clear);
                let blocks: usize = actions[1..].iter().map(Action::weight).sum();
                assert_eq!(blocks, 6, "both batches are still tracked");
            }
            other => panic!("expected a resync, got {other:?}"),
        }
        assert!(pipeline.try_take(100, &metrics).is_none());
    }

    #[test]
    fn takes_in_order_up_to_the_weight() {
        let metrics = Metrics::new();
        let pipeline = Pipeline::new(1, &options(), 100);
        pipeline.apply_batch(0, batch(0, 2), &metrics);
        pipeline.apply_batch(0, batch(10, 2), &metrics);
        let Some(Work::Actions(first)) = pipeline.try_take(2, &metrics) else {
            panic!("expected actions");
        };
        assert_eq!(first.len(), 1);
        let Some(Work::Actions(second)) = pipeline.try_take(2, &metrics) else {
            panic!("expected actions");
        };
        assert_eq!(second.len(), 1);
        assert_ne!(first, second);
    }
}
