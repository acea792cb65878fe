//! One engine publisher: ZMQ SUB, sequence tracking, replay, reconnects.
//!
//! Frames are `[topic, seq (8-byte big-endian), payload]` (`[seq, payload]`
//! is accepted too). Sequence numbers must grow by one; a jump is a gap:
//! the missing range is requested from the engine's replay socket (ZMQ
//! ROUTER; request = start seq as 8 bytes big-endian; replies `[seq,
//! payload]` or `[topic, seq, payload]`, ended by seq = -1) and applied in
//! order before the frame that revealed the gap. What replay cannot supply
//! is counted as missed. A sequence that goes backwards means the engine
//! restarted with an empty cache: the replica is cleared.
//!
//! The first frame after start-up is a gap too when its sequence is above
//! 0: the engine published batches 0.. before this subscriber listened (it
//! started later, or restarted). With a replay endpoint they are requested
//! from sequence 0 and applied before that frame, so blocks stored while
//! the subscriber was away (and every later block chained to them) are
//! known; what the engine's replay buffer no longer holds is counted as
//! missed. `--replay-timeout` bounds the wait for each reply message, so
//! a long replay is not cut short while it keeps flowing.
//!
//! The socket reconnects by itself after a disconnect; a failed connect or
//! receive error recreates it after capped, jittered exponential backoff. Nothing
//! here panics on engine data: malformed frames are counted and skipped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use inference_cache_runtime::Backoff;
use tokio::sync::watch;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::args::{EndpointSettings, Settings};
use crate::decode::decode_batch;
use crate::event::EventBatch;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;

/// Time allowed for one connect attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Sequence number that ends a replay answer (-1 as 8 bytes).
const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// Where a sequence number stands relative to the last one applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SequenceVerdict {
    /// First message seen.
    First,
    /// The expected next number.
    Next,
    /// Numbers `from..to` are missing.
    Gap {
        /// First missing number.
        from: u64,
        /// The number received (exclusive end of the gap).
        to: u64,
    },
    /// Not after the last one: the publisher restarted.
    Restart,
}

/// Classifies `seq` against the last applied number.
pub(crate) fn classify(last: Option<u64>, seq: u64) -> SequenceVerdict {
    match last {
        None => SequenceVerdict::First,
        Some(last) if seq == last.wrapping_add(1) => SequenceVerdict::Next,
        Some(last) if seq > last => SequenceVerdict::Gap {
            from: last + 1,
            to: seq,
        },
        Some(_) => SequenceVerdict::Restart,
    }
}

/// Splits a live frame into (seq, payload).
fn split_frame(message: &ZmqMessage) -> Option<(u64, &Bytes)> {
    let (seq, payload) = match message.len() {
        3 => (message.get(1)?, message.get(2)?),
        2 => (message.get(0)?, message.get(1)?),
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

/// Reader task of one endpoint.
pub(crate) struct Source {
    index: usize,
    endpoint: EndpointSettings,
    topic: String,
    replay_timeout: Duration,
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
    last_seq: Option<u64>,
    replay_socket: Option<DealerSocket>,
}

impl Source {
    pub(crate) fn new(
        index: usize,
        settings: &Settings,
        pipeline: Arc<Pipeline>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            index,
            endpoint: settings.endpoints[index].clone(),
            topic: settings.topic.clone(),
            replay_timeout: settings.replay_timeout,
            pipeline,
            metrics,
            last_seq: None,
            replay_socket: None,
        }
    }

    /// Receives until `shutdown` flips to true.
    pub(crate) async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        while !*shutdown.borrow() {
            let connected = tokio::select! {
                connected = self.connect() => connected,
                _ = shutdown.changed() => return,
            };
            let mut socket = match connected {
                Ok(socket) => socket,
                Err(error) => {
                    self.metrics.zmq_errors.inc();
                    tracing::warn!(endpoint = %self.endpoint.endpoint, %error, "cannot subscribe");
                    backoff.wait(shutdown.changed()).await;
                    continue;
                }
            };
            self.metrics.zmq_connects.inc();
            tracing::info!(endpoint = %self.endpoint.endpoint, "subscribed to KV events");
            backoff.reset();
            loop {
                let received = tokio::select! {
                    received = socket.recv() => received,
                    _ = shutdown.changed() => return,
                };
                match received {
                    Ok(message) => self.handle(&message).await,
                    Err(error) => {
                        self.metrics.zmq_errors.inc();
                        tracing::warn!(endpoint = %self.endpoint.endpoint, %error, "receive failed; resubscribing");
                        break;
                    }
                }
            }
            drop(socket);
            backoff.wait(shutdown.changed()).await;
        }
    }

    async fn connect(&self) -> Result<SubSocket, String> {
        let mut socket = SubSocket::new();
        match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(&self.endpoint.endpoint)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(error.to_string()),
            Err(_) => return Err("connect timed out".into()),
        }
        socket
            .subscribe(&self.topic)
            .await
            .map_err(|e| e.to_string())?;
        Ok(socket)
    }

    /// Handles one live frame.
    pub(crate) async fn handle(&mut self, message: &ZmqMessage) {
        self.metrics.frames.inc();
        let Some((seq, payload)) = split_frame(message) else {
            self.metrics.frames_malformed.inc();
            return;
        };
        match classify(self.last_seq, seq) {
            SequenceVerdict::First if seq > 0 && self.endpoint.replay.is_some() => {
                self.metrics.first_frame_replays.inc();
                tracing::info!(
                    endpoint = %self.endpoint.endpoint,
                    seq,
                    "first frame is not sequence 0: replaying what the engine published before"
                );
                self.recover(0, seq).await;
            }
            SequenceVerdict::First | SequenceVerdict::Next => {}
            SequenceVerdict::Gap { from, to } => {
                self.metrics.sequence_gaps.inc();
                tracing::warn!(endpoint = %self.endpoint.endpoint, from, to, "sequence gap");
                self.recover(from, to).await;
            }
            SequenceVerdict::Restart => {
                self.metrics.publisher_restarts.inc();
                tracing::warn!(
                    endpoint = %self.endpoint.endpoint,
                    seq,
                    last = ?self.last_seq,
                    "sequence went backwards: engine restarted, clearing its blocks"
                );
                self.pipeline.reset_endpoint(self.index, &self.metrics);
            }
        }
        self.last_seq = Some(seq);
        self.apply_payload(payload);
    }

    fn apply_payload(&self, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(batch) => self.apply(batch),
            Err(error) => {
                self.metrics.frames_malformed.inc();
                tracing::debug!(%error, "skipping malformed KV-event frame");
            }
        }
    }

    fn apply(&self, batch: EventBatch) {
        self.pipeline.apply_batch(self.index, batch, &self.metrics);
    }

    /// Fetches `from..to` from the replay socket and applies it in order.
    async fn recover(&mut self, from: u64, to: u64) {
        let wanted = to - from;
        if self.endpoint.replay.is_none() {
            self.metrics.batches_missed.inc_by(wanted);
            return;
        }
        match self.replay(from, to).await {
            Ok(batches) => {
                let got = batches.len() as u64;
                let mut expected = from;
                for (seq, payload) in batches {
                    if seq < expected {
                        continue;
                    }
                    expected = seq + 1;
                    self.metrics.batches_replayed.inc();
                    self.apply_payload(&payload);
                }
                self.metrics
                    .batches_missed
                    .inc_by(wanted.saturating_sub(got));
            }
            Err(error) => {
                self.replay_socket = None;
                self.metrics.replay_failures.inc();
                self.metrics.batches_missed.inc_by(wanted);
                tracing::warn!(endpoint = %self.endpoint.endpoint, %error, "replay failed");
            }
        }
    }

    async fn replay(&mut self, from: u64, to: u64) -> Result<Vec<(u64, Bytes)>, String> {
        let mut deadline = Instant::now() + self.replay_timeout;
        let replay_endpoint = self.endpoint.replay.clone().ok_or("no replay endpoint")?;
        if self.replay_socket.is_none() {
            let mut socket = DealerSocket::new();
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, socket.connect(&replay_endpoint)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => return Err(error.to_string()),
                Err(_) => return Err("replay connect timed out".into()),
            }
            self.replay_socket = Some(socket);
        }
        let socket = self.replay_socket.as_mut().ok_or("no replay socket")?;
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|e| e.to_string())?;
        let remaining = deadline.saturating_duration_since(Instant::now());
        tokio::time::timeout(remaining, socket.send(request))
            .await
            .map_err(|_| "replay request timed out".to_owned())?
            .map_err(|e| e.to_string())?;
        let mut batches = Vec::new();
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let reply = tokio::time::timeout(remaining, socket.recv())
                .await
                .map_err(|_| "replay answer timed out".to_owned())?
                .map_err(|e| e.to_string())?;
            // Each reply earns the next one a full timeout.
            deadline = Instant::now() + self.replay_timeout;
            let mut frames = reply.into_vec();
            if frames.first().is_some_and(Bytes::is_empty) {
                frames.remove(0);
            }
            let (seq, payload) = match frames.len() {
                2 => (&frames[0], &frames[1]),
                3 => (&frames[1], &frames[2]),
                n => return Err(format!("replay reply with {n} frames")),
            };
            if seq.as_ref() == END_OF_REPLAY {
                break;
            }
            let seq: [u8; 8] = seq
                .as_ref()
                .try_into()
                .map_err(|_| "replay seq is not 8 bytes".to_owned())?;
            let seq = u64::from_be_bytes(seq);
            if (from..to).contains(&seq) {
                batches.push((seq, payload.clone()));
            }
        }
        batches.sort_by_key(|(seq, _)| *seq);
        Ok(batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_classification() {
        assert_eq!(classify(None, 7), SequenceVerdict::First);
        assert_eq!(classify(Some(7), 8), SequenceVerdict::Next);
        assert_eq!(
            classify(Some(7), 10),
            SequenceVerdict::Gap { from: 8, to: 10 }
        );
        assert_eq!(classify(Some(7), 7), SequenceVerdict::Restart);
        assert_eq!(classify(Some(7), 0), SequenceVerdict::Restart);
    }

    #[test]
    fn frames_split_with_and_without_topic() {
        let seq = Bytes::copy_from_slice(&5u64.to_be_bytes());
        let payload = Bytes::from_static(b"p");
        let three =
            ZmqMessage::try_from(vec![Bytes::from_static(b"t"), seq.clone(), payload.clone()])
                .expect("message");
        assert_eq!(
            split_frame(&three).map(|(s, p)| (s, p.clone())),
            Some((5, payload.clone()))
        );
        let two = ZmqMessage::try_from(vec![seq, payload.clone()]).expect("message");
        assert_eq!(split_frame(&two).map(|(s, _)| s), Some(5));
        let bad = ZmqMessage::try_from(vec![
            Bytes::from_static(b"t"),
            Bytes::from_static(b"123"),
            payload,
        ])
        .expect("message");
        assert!(split_frame(&bad).is_none());
        let one = ZmqMessage::from(Bytes::from_static(b"x"));
        assert!(split_frame(&one).is_none());
    }
}
