//! Fleet membership and load: which replicas serve a `(tenant, model)`, which
//! of them are alive, and how much work is already queued on each.
//!
//! A replica *joins* the serving set of a `(tenant, model)` when it announces
//! itself: any update for it (stats-only included; the update's hash scheme
//! is recorded) or a `REPLICA_UPDATED` event naming tenant and model (no
//! scheme: it serves every scheme of that pair until an update names one).
//! It *leaves* on `ALL_CLEARED` (for the tenant / model the event names,
//! every one when empty). Liveness is read at lookup time, so nothing has to
//! run for a silent replica to drop out:
//!
//! - a replica that has heartbeated (`REPLICA_UPDATED` naming tenant and
//!   model) is live while it was heard from within the tenant's
//!   `replicaTimeout`;
//! - one that never has (an older producer that only reports blocks) is live
//!   while heard from within `replicaTimeout` or while it holds entries in
//!   the scope, so its entries keep the contract's meaning until they age out.
//!
//! Load: each replica keeps its last [`ReplicaStatsReport`] and the prefill
//! tokens this index itself hinted to it since that report (`pending`), so a
//! burst of requests that arrives between two stats reports spreads instead of
//! piling onto the replica that looked idle. A stats report resets `pending`.
//! It also keeps a decayed count of the requests hinted to it (`assigned`),
//! which spreads new sessions evenly even when every replica is idle.
//!
//! Concurrency: one reader-writer lock around the `Fleet` in the index.
//! Lookups take it shared and add to `pending` with an atomic. An update
//! from a known member only moves the replica's last-heard time, an atomic,
//! and writes its stats, if it brings any, into the record's [`StatsCell`],
//! which readers never wait for: both under the shared lock too
//! ([`Fleet::touch`]), so the steady stream of block and stats reports never
//! takes the lock exclusively and never holds a lookup up; joins, leaves and
//! first contact take it exclusively. Cost: the serving set
//! of a lookup is one hash probe plus a pass over that pair's members.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};

use crossbeam_utils::CachePadded;
use hashbrown::HashMap;
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::catalog::{IdList, NameId, ReplicaId, shrink_due, shrink_map};
use crate::messages::ReplicaStatsReport;

/// What the index knows about one replica.
#[derive(Debug, Default)]
pub(crate) struct ReplicaRecord {
    /// Last statistics reported for it, and when they arrived.
    pub stats: StatsCell,
    /// Last update or event from it (ms).
    last_heard_ms: AtomicU64,
    /// It has sent a `REPLICA_UPDATED` naming tenant and model, so silence
    /// longer than `replicaTimeout` means it is gone.
    heartbeats: AtomicBool,
    /// Uncached prefill tokens hinted to it since `stats_at_ms`.
    pub pending_tokens: AtomicU64,
    /// Requests hinted to it, decayed with the policy's half-life.
    assigned: Decayed,
    /// Entries it reported stored and evicted recently (decayed counts),
    /// each on a cache line of its own: ingest writes them with every report
    /// that adds or evicts entries, and every lookup reads the fields around
    /// them and the evicted count (the stored one only once it evicts).
    stored: CachePadded<Decayed>,
    evicted: CachePadded<Decayed>,
    /// Uncached tokens of the last [`HINT_RING`] requests hinted to it (a
    /// ring written at `hints`, the count of every hint), and that count when
    /// its last stats arrived. Its queue is FIFO, so the requests it reported
    /// waiting are the last ones sent before the report, and the ones it
    /// reported running came just before those.
    hint_tokens: [AtomicU64; HINT_RING],
    hints: AtomicU64,
    hints_at_stats: AtomicU64,
}

/// Hinted requests whose size a replica record remembers.
const HINT_RING: usize = 32;

/// A replica's last stats report, written through a shared reference, so a
/// stats report from a known member takes the fleet's lock shared like any
/// other report: the steady stream of them neither waits for lookups nor
/// holds one up.
///
/// Lookups read the figures they rank with ([`StatsView`]) from two slots
/// that writes fill in turn, so a reader never waits for a writer. Reports
/// are numbered; `begun` and `done` hold the number of the last one started
/// and finished. Report `n` raises `begun` to `n`, then (after a `Release`
/// fence) fills slot `n % 2`, then publishes `done = n` with `Release`. A
/// reader loads `done` (`Acquire`), reads that slot, and after an `Acquire`
/// fence loads `begun`: the next write to its slot is report `done + 2`, and
/// had the reader seen any word of it the fences would show it that
/// report's `begun`, so `begun <= done + 1` proves the three words are one
/// report's. Otherwise (two reports landed while it read) it reads again.
///
/// The whole report, strings included, is kept beside it for snapshots;
/// its mutex also makes the writers of one record take turns.
#[derive(Debug, Default)]
pub(crate) struct StatsCell {
    /// On a cache line of its own: lookups write the counters beside it in
    /// the record (`pending`, the hint ring) with every hint.
    figures: CachePadded<StatsFigures>,
    report: Mutex<Option<(ReplicaStatsReport, u64)>>,
}

/// The part of a [`StatsCell`] lookups read: 64 bytes.
#[derive(Debug, Default)]
struct StatsFigures {
    begun: AtomicU64,
    done: AtomicU64,
    slots: [StatsSlot; 2],
}

/// One slot of a [`StatsCell`]: a [`StatsView`] in three words.
#[derive(Debug, Default)]
struct StatsSlot {
    at_ms: AtomicU64,
    /// `requests_waiting << 32 | requests_running`.
    queue: AtomicU64,
    /// `pressure` bits `<< 32 |` `hit_rate` bits.
    rates: AtomicU64,
}

/// What lookups read of a replica's last stats report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StatsView {
    /// When it arrived (ms).
    pub at_ms: u64,
    pub requests_waiting: u32,
    pub requests_running: u32,
    pub pressure: f32,
    pub hit_rate: f32,
}

impl StatsCell {
    /// The last report's figures; `None` before the first.
    pub fn get(&self) -> Option<StatsView> {
        loop {
            if let Some(view) = self.read_once() {
                return view;
            }
            std::hint::spin_loop();
        }
    }

    /// One read of the last report's figures: `None` when two reports
    /// landed meanwhile and it has to be read again.
    fn read_once(&self) -> Option<Option<StatsView>> {
        let f = &*self.figures;
        let done = f.done.load(Ordering::Acquire);
        if done == 0 {
            return Some(None);
        }
        let slot = &f.slots[(done % 2) as usize];
        let at_ms = slot.at_ms.load(Ordering::Relaxed);
        let queue = slot.queue.load(Ordering::Relaxed);
        let rates = slot.rates.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        (f.begun.load(Ordering::Relaxed) <= done + 1).then_some(Some(StatsView {
            at_ms,
            requests_waiting: (queue >> 32) as u32,
            requests_running: queue as u32,
            pressure: f32::from_bits((rates >> 32) as u32),
            hit_rate: f32::from_bits(rates as u32),
        }))
    }

    /// Records `report`, arrived at `now_ms`.
    pub fn set(&self, report: ReplicaStatsReport, now_ms: u64) {
        let mut whole = self.report.lock();
        // Writers take turns under the mutex, so `done` is the last report.
        let f = &*self.figures;
        let n = f.done.load(Ordering::Relaxed) + 1;
        f.begun.store(n, Ordering::Relaxed);
        fence(Ordering::Release);
        let slot = &f.slots[(n % 2) as usize];
        slot.at_ms.store(now_ms, Ordering::Relaxed);
        slot.queue.store(
            u64::from(report.requests_waiting) << 32 | u64::from(report.requests_running),
            Ordering::Relaxed,
        );
        slot.rates.store(
            u64::from(report.pressure.to_bits()) << 32 | u64::from(report.hit_rate.to_bits()),
            Ordering::Relaxed,
        );
        f.done.store(n, Ordering::Release);
        *whole = Some((report, now_ms));
    }

    /// The whole last report and when it arrived (ms), for snapshots.
    pub fn report(&self) -> Option<(ReplicaStatsReport, u64)> {
        self.report.lock().clone()
    }
}

/// A count that halves every half-life (`f64` bits) and when it last moved.
#[derive(Debug, Default)]
struct Decayed {
    value: AtomicU64,
    at_ms: AtomicU64,
}

impl Decayed {
    fn get(&self, now_ms: u64, half_life_ms: u64) -> f64 {
        let value = f64::from_bits(self.value.load(Ordering::Relaxed));
        if value == 0.0 {
            // Nothing to decay: no `exp` (a lookup reads a few of these per
            // member, and a replica never hinted to has a huge age).
            return value;
        }
        let at = self.at_ms.load(Ordering::Relaxed);
        value * decay(now_ms.saturating_sub(at), half_life_ms)
    }

    fn add(&self, now_ms: u64, half_life_ms: u64, amount: f64) {
        let next = self.get(now_ms, half_life_ms) + amount;
        self.value.store(next.to_bits(), Ordering::Relaxed);
        self.at_ms.store(now_ms, Ordering::Relaxed);
    }
}

/// Half-life of the stored and evicted counts behind [`ReplicaRecord::churn`].
const CHURN_HALF_LIFE_MS: u64 = 60_000;

impl ReplicaRecord {
    /// Last update or event from it (ms).
    pub fn last_heard_ms(&self) -> u64 {
        self.last_heard_ms.load(Ordering::Relaxed)
    }

    /// Marks it heard from at `now_ms` (never moves back).
    pub fn heard(&self, now_ms: u64) {
        // Read first: a replica reports many times within one millisecond
        // of the clock, and every lookup reads this line, so a locked write
        // that changes nothing would take it from their cores each time.
        if self.last_heard_ms.load(Ordering::Relaxed) < now_ms {
            self.last_heard_ms.fetch_max(now_ms, Ordering::Relaxed);
        }
    }

    /// Whether it heartbeats (see the field).
    pub fn heartbeats(&self) -> bool {
        self.heartbeats.load(Ordering::Relaxed)
    }

    /// Notes that it heartbeats.
    pub fn set_heartbeats(&self) {
        self.heartbeats.store(true, Ordering::Relaxed);
    }

    /// Records new stats and resets what was hinted since the last ones. A
    /// hint counted while this runs may be dropped from `pending`, as if the
    /// report had counted it.
    pub fn set_stats(&self, stats: ReplicaStatsReport, now_ms: u64) {
        self.stats.set(stats, now_ms);
        self.pending_tokens.store(0, Ordering::Relaxed);
        self.hints_at_stats
            .store(self.hints.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Tokens hinted to it since its last stats report.
    pub fn pending(&self) -> u64 {
        self.pending_tokens.load(Ordering::Relaxed)
    }

    /// Counts `tokens` of prefill just hinted to it.
    pub fn add_pending(&self, tokens: u64) {
        self.pending_tokens.fetch_add(tokens, Ordering::Relaxed);
        let at = self.hints.fetch_add(1, Ordering::Relaxed);
        self.hint_tokens[(at as usize) % HINT_RING].store(tokens, Ordering::Relaxed);
    }

    /// The uncached tokens of `count` requests hinted to it before its last
    /// stats report, after skipping the `skip` most recent of those, and how
    /// many of them it still remembers (the rest are older than the ring).
    pub fn hinted_before_stats(&self, skip: u64, count: u64) -> (u64, u64) {
        let end = self
            .hints_at_stats
            .load(Ordering::Relaxed)
            .saturating_sub(skip);
        let remembered_from = self
            .hints
            .load(Ordering::Relaxed)
            .saturating_sub(HINT_RING as u64);
        let start = end.saturating_sub(count).max(remembered_from);
        let tokens = (start..end)
            .map(|at| self.hint_tokens[(at as usize) % HINT_RING].load(Ordering::Relaxed))
            .sum();
        (tokens, end.saturating_sub(start))
    }

    /// Requests hinted to it recently: each counts 1, halving every
    /// `half_life_ms`.
    pub fn assigned(&self, now_ms: u64, half_life_ms: u64) -> f64 {
        self.assigned.get(now_ms, half_life_ms)
    }

    /// Notes entries it reported stored (`stored`) or evicted.
    pub fn note_churn(&self, now_ms: u64, stored: u64, evicted: u64) {
        if stored > 0 {
            self.stored.add(now_ms, CHURN_HALF_LIFE_MS, stored as f64);
        }
        if evicted > 0 {
            self.evicted.add(now_ms, CHURN_HALF_LIFE_MS, evicted as f64);
        }
    }

    /// How full its cache runs: recent evictions per recent store, in
    /// [0, 1] (0 while it only grows; near 1 once every store evicts).
    pub fn churn(&self, now_ms: u64) -> f64 {
        // Without recent evictions the ratio is 0 whatever was stored: the
        // stored count (an `exp`) is only worked out when it matters.
        let evicted = self.evicted.get(now_ms, CHURN_HALF_LIFE_MS);
        if evicted == 0.0 {
            return 0.0;
        }
        let stored = self.stored.get(now_ms, CHURN_HALF_LIFE_MS);
        if stored < 1.0 {
            return 0.0;
        }
        (evicted / stored).min(1.0)
    }

    /// Counts one request just hinted to it. Concurrent callers may lose an
    /// increment: this is a balancing signal, not an account.
    pub fn add_assigned(&self, now_ms: u64, half_life_ms: u64) {
        self.assigned.add(now_ms, half_life_ms, 1.0);
    }
}

/// `0.5^(elapsed / half_life)`.
fn decay(elapsed_ms: u64, half_life_ms: u64) -> f64 {
    if half_life_ms == 0 {
        return 0.0;
    }
    if elapsed_ms == 0 {
        // exp(-0) = 1 exactly.
        return 1.0;
    }
    (-(elapsed_ms as f64) / half_life_ms as f64 * std::f64::consts::LN_2).exp()
}

/// One member of a `(tenant, model)` serving set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub replica: ReplicaId,
    /// Hash schemes it reported under; empty when it only announced itself
    /// (inline: a lookup checks every member's).
    pub schemes: SmallVec<[NameId; 2]>,
}

impl Member {
    /// Whether it serves `scheme`.
    pub fn serves(&self, scheme: Option<NameId>) -> bool {
        match (self.schemes.as_slice(), scheme) {
            ([], _) => true,
            ([only], Some(s)) => *only == s,
            (schemes, Some(s)) => schemes.contains(&s),
            (_, None) => false,
        }
    }
}

/// Replica records by replica id. Ids are the catalog's (handed out in
/// order, never reused), so a record is two index steps away in an
/// [`IdList`] instead of a hash probe: a lookup reads the record of every
/// member of its serving set (eight probes were 10 % of a lookup's
/// instructions). Records are boxed, so a chunk of the list is one pointer
/// per id; a chunk whose records all went is dropped.
#[derive(Debug, Default)]
pub(crate) struct RecordTable(IdList<Box<ReplicaRecord>>);

impl RecordTable {
    pub fn get(&self, id: ReplicaId) -> Option<&ReplicaRecord> {
        self.0.get(id).map(|r| &**r)
    }

    pub fn contains(&self, id: ReplicaId) -> bool {
        self.get(id).is_some()
    }

    /// Whether `id` heartbeats and has not been heard from for more than
    /// `limit_ms` (a replica that never heartbeated is never silent).
    fn silent(&self, id: ReplicaId, now_ms: u64, limit_ms: u64) -> bool {
        self.get(id)
            .is_some_and(|r| r.heartbeats() && now_ms.saturating_sub(r.last_heard_ms()) > limit_ms)
    }

    /// The record of `id`, created empty when it has none.
    pub fn get_or_default(&mut self, id: ReplicaId) -> &mut ReplicaRecord {
        self.0.get_or_insert_with(id, Box::default)
    }

    pub fn remove(&mut self, id: ReplicaId) {
        self.0.remove(id);
    }

    /// Ids that have a record, in order.
    pub fn ids(&self) -> impl Iterator<Item = ReplicaId> + '_ {
        self.0.with_ids().map(|(id, _)| id)
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.ids().next().is_none()
    }

    fn shrink(&mut self) {
        self.0.shrink();
    }

    /// Record slots and chunk pointers allocated.
    #[cfg(test)]
    fn room(&self) -> usize {
        self.0.room()
    }
}

/// Replica records and the serving sets.
#[derive(Debug, Default)]
pub(crate) struct Fleet {
    pub records: RecordTable,
    /// Sorted by replica id, so a lookup's serving set needs no sort.
    members: HashMap<[NameId; 2], Vec<Member>>,
    /// The pairs each replica is a member of: leaving and listing visit
    /// only those, never every serving set.
    pairs: HashMap<ReplicaId, SmallVec<[[NameId; 2]; 2]>>,
    /// Where recent requests' deepest matches ended (see the `cost` module).
    pub reuse: crate::cost::ReuseCounts,
}

impl Fleet {
    /// Marks `replica` heard from at `now_ms` and returns its record.
    pub fn heard(&mut self, replica: ReplicaId, now_ms: u64) -> &mut ReplicaRecord {
        let record = self.records.get_or_default(replica);
        record.heard(now_ms);
        record
    }

    /// Under the shared lock: marks a known `replica` heard from at `now_ms`
    /// when it is already a member of `(tenant, model)` serving `scheme`
    /// (`join`), so nothing else has to change. False when the exclusive
    /// path ([`heard`](Self::heard), [`join`](Self::join)) is needed.
    pub fn touch(&self, replica: ReplicaId, now_ms: u64, join: Option<[NameId; 3]>) -> bool {
        let Some(record) = self.records.get(replica) else {
            return false;
        };
        if let Some([tenant, model, scheme]) = join {
            let members = self.members(tenant, model);
            let member = members
                .binary_search_by_key(&replica, |m| m.replica)
                .ok()
                .map(|i| &members[i]);
            if !member.is_some_and(|m| m.schemes.contains(&scheme)) {
                return false;
            }
        }
        record.heard(now_ms);
        true
    }

    /// Records new stats for `replica`, creating its record if it has none.
    pub fn record_stats(&mut self, replica: ReplicaId, stats: ReplicaStatsReport, now_ms: u64) {
        self.records
            .get_or_default(replica)
            .set_stats(stats, now_ms);
    }

    /// Adds `replica` to the serving set of `(tenant, model)`, under `scheme`
    /// when known.
    pub fn join(
        &mut self,
        replica: ReplicaId,
        tenant: NameId,
        model: NameId,
        scheme: Option<NameId>,
    ) {
        let members = self.members.entry([tenant, model]).or_default();
        match members.binary_search_by_key(&replica, |m| m.replica) {
            Ok(i) => {
                let member = &mut members[i];
                if let Some(s) = scheme
                    && !member.schemes.contains(&s)
                {
                    member.schemes.push(s);
                }
            }
            Err(i) => {
                members.insert(
                    i,
                    Member {
                        replica,
                        schemes: scheme.into_iter().collect(),
                    },
                );
                self.pairs.entry(replica).or_default().push([tenant, model]);
            }
        }
    }

    /// Removes `replica` from the serving sets of the pairs that match
    /// (`None` matches every tenant / model); a replica left in none has
    /// its record dropped too. Returns how many sets it left.
    pub fn leave(
        &mut self,
        replica: ReplicaId,
        tenant: Option<NameId>,
        model: Option<NameId>,
    ) -> usize {
        let mut left = 0;
        if let Some(pairs) = self.pairs.get_mut(&replica) {
            pairs.retain(|&mut [t, m]| {
                if !(tenant.is_none_or(|x| x == t) && model.is_none_or(|x| x == m)) {
                    return true;
                }
                if let Some(members) = self.members.get_mut(&[t, m]) {
                    let before = members.len();
                    members.retain(|member| member.replica != replica);
                    left += before - members.len();
                    if members.is_empty() {
                        self.members.remove(&[t, m]);
                    }
                }
                false
            });
        }
        if self.pairs.get(&replica).is_none_or(|p| p.is_empty()) {
            self.pairs.remove(&replica);
            self.records.remove(replica);
        }
        left
    }

    /// Members of `(tenant, model)`, live or not, sorted by replica id.
    pub fn members(&self, tenant: NameId, model: NameId) -> &[Member] {
        self.members
            .get(&[tenant, model])
            .map_or(&[], Vec::as_slice)
    }

    /// `(tenant, model)` pairs `replica` is a member of.
    pub fn memberships_of(&self, replica: ReplicaId) -> Vec<[NameId; 2]> {
        let mut out: Vec<[NameId; 2]> = self
            .pairs
            .get(&replica)
            .map_or_else(Vec::new, |p| p.to_vec());
        out.sort_unstable();
        out
    }

    /// [`record_live`](Self::record_live) of `replica`'s record.
    #[cfg(test)]
    pub fn is_live(
        &self,
        replica: ReplicaId,
        now_ms: u64,
        timeout_ms: u64,
        holds: impl FnOnce() -> bool,
    ) -> bool {
        Self::record_live(self.records.get(replica), now_ms, timeout_ms, holds)
    }

    /// Whether the replica of `record` (`None`: it has none) counts as
    /// alive at `now_ms`: heard from within `timeout_ms`, or for one that
    /// never heartbeated, holding entries in the scope asked about
    /// (`holds`, consulted only then).
    pub fn record_live(
        record: Option<&ReplicaRecord>,
        now_ms: u64,
        timeout_ms: u64,
        holds: impl FnOnce() -> bool,
    ) -> bool {
        let Some(record) = record else {
            return holds();
        };
        let recent = now_ms.saturating_sub(record.last_heard_ms()) <= timeout_ms;
        if record.heartbeats() {
            recent
        } else {
            recent || holds()
        }
    }

    /// Whether [`expire`](Self::expire) would end a membership: read only,
    /// so a sweep takes the fleet exclusively only when one is due.
    pub fn any_expired(&self, now_ms: u64, timeout_ms: impl Fn(NameId) -> u64) -> bool {
        self.members.iter().any(|(&[tenant, _], members)| {
            let limit = timeout_ms(tenant);
            members
                .iter()
                .any(|m| self.records.silent(m.replica, now_ms, limit))
        })
    }

    /// Drops members whose heartbeats stopped more than `timeout_ms` ago.
    /// Returns how many memberships ended.
    pub fn expire(&mut self, now_ms: u64, timeout_ms: impl Fn(NameId) -> u64) -> usize {
        let (records, pairs) = (&self.records, &mut self.pairs);
        let mut ended = 0;
        self.members.retain(|&[tenant, model], members| {
            let limit = timeout_ms(tenant);
            members.retain(|m| {
                let keep = !records.silent(m.replica, now_ms, limit);
                if !keep {
                    ended += 1;
                    if let Some(p) = pairs.get_mut(&m.replica) {
                        p.retain(|&mut pair| pair != [tenant, model]);
                        if p.is_empty() {
                            pairs.remove(&m.replica);
                        }
                    }
                }
                keep
            });
            !members.is_empty()
        });
        ended
    }

    /// Gives back the room of maps that emptied out (after a flood of
    /// names is cleared, their capacity would otherwise stay at the peak).
    pub fn shrink(&mut self) {
        self.records.shrink();
        shrink_map(&mut self.members);
        shrink_map(&mut self.pairs);
    }

    /// Whether [`shrink`](Self::shrink) would give back room.
    pub fn shrink_due(&self) -> bool {
        self.records.0.shrink_due()
            || shrink_due(self.members.len(), self.members.capacity())
            || shrink_due(self.pairs.len(), self.pairs.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(n: u32) -> ReplicaStatsReport {
        ReplicaStatsReport {
            requests_waiting: n,
            requests_running: n ^ 0x5555,
            pressure: n as f32,
            hit_rate: -(n as f32),
            ..Default::default()
        }
    }

    /// Whether `view` is all of report `n` (as [`report`] makes it, arrived
    /// at `n` ms).
    fn is_report(view: StatsView, n: u32) -> bool {
        view == StatsView {
            at_ms: u64::from(n),
            requests_waiting: n,
            requests_running: n ^ 0x5555,
            pressure: n as f32,
            hit_rate: -(n as f32),
        }
    }

    #[test]
    fn a_stats_read_is_taken_again_only_when_its_slot_was_rewritten() {
        let cell = StatsCell::default();
        assert_eq!(cell.get(), None);
        cell.set(report(1), 1);
        cell.set(report(2), 2);
        assert!(is_report(cell.get().expect("stats"), 2));
        assert_eq!(
            cell.report().map(|(r, at)| (r.requests_waiting, at)),
            Some((2, 2))
        );
        // Report 3 under way writes the other slot: the read stands.
        cell.figures.begun.store(3, Ordering::Relaxed);
        assert!(cell.read_once().flatten().is_some_and(|v| is_report(v, 2)));
        // Report 4 under way writes this slot: read again.
        cell.figures.begun.store(4, Ordering::Relaxed);
        assert_eq!(cell.read_once(), None);
    }

    #[test]
    fn stats_reads_beside_a_writer_see_whole_reports_in_order() {
        let cell = StatsCell::default();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let (mut last, mut reads) = (0, 0u64);
                        while !stop.load(Ordering::Relaxed) {
                            if let Some(view) = cell.get() {
                                let n = view.requests_waiting;
                                assert!(is_report(view, n), "a torn read: {view:?}");
                                assert!(n >= last, "report {n} read after {last}");
                                last = n;
                            }
                            reads += 1;
                        }
                        reads
                    })
                })
                .collect();
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
            let mut n = 0;
            while std::time::Instant::now() < deadline {
                n += 1;
                cell.set(report(n), u64::from(n));
            }
            stop.store(true, Ordering::Relaxed);
            for r in readers {
                assert!(r.join().expect("reader") > 0);
            }
            assert!(is_report(cell.get().expect("stats"), n));
        });
    }

    #[test]
    fn join_leave_and_schemes() {
        let mut fleet = Fleet::default();
        fleet.join(1, 10, 20, Some(30));
        fleet.join(1, 10, 20, Some(31));
        fleet.join(2, 10, 20, None);
        fleet.join(1, 11, 20, Some(30));
        let members = fleet.members(10, 20);
        assert_eq!(members.len(), 2);
        assert!(members[0].serves(Some(31)) && !members[0].serves(Some(32)));
        assert!(
            members[1].serves(Some(99)),
            "announced without a scheme serves all"
        );
        assert_eq!(fleet.memberships_of(1), vec![[10, 20], [11, 20]]);
        assert_eq!(fleet.leave(1, Some(10), None), 1);
        assert_eq!(fleet.members(10, 20).len(), 1);
        fleet.heard(1, 5);
        assert_eq!(fleet.leave(1, None, None), 1);
        assert!(fleet.members(11, 20).is_empty());
        assert!(
            !fleet.records.contains(1),
            "a replica in no set keeps no record"
        );
    }

    #[test]
    fn record_table_finds_keeps_and_drops_records_by_id() {
        let mut table = RecordTable::default();
        for id in [3, 300, 700, 255, 256] {
            table.get_or_default(id).heard(u64::from(id));
        }
        assert_eq!(table.ids().collect::<Vec<_>>(), [3, 255, 256, 300, 700]);
        assert_eq!(table.get(300).map(ReplicaRecord::last_heard_ms), Some(300));
        assert!(table.get(301).is_none() && table.get(1 << 30).is_none());
        // The same record again, not a new one.
        table.get_or_default(300).heard(1);
        assert_eq!(table.get(300).map(ReplicaRecord::last_heard_ms), Some(300));
        table.remove(700);
        table.remove(700);
        assert!(!table.contains(700));
        assert_eq!(table.0.chunks(), 2, "700's chunk went");
        table.shrink();
        assert_eq!(table.0.chunk_slots(), 2, "and its pointer");
        for id in [3, 255, 256, 300] {
            table.remove(id);
        }
        assert!(table.is_empty());
        assert_eq!(table.ids().count(), 0);
    }

    #[test]
    fn members_stay_sorted_by_replica_whatever_the_join_order() {
        let mut fleet = Fleet::default();
        for replica in [7, 3, 9, 1, 5, 3, 8] {
            fleet.join(replica, 10, 20, Some(30));
        }
        fleet.join(5, 10, 20, Some(31));
        let order: Vec<ReplicaId> = fleet.members(10, 20).iter().map(|m| m.replica).collect();
        assert_eq!(order, [1, 3, 5, 7, 8, 9]);
        assert!(fleet.members(10, 20)[2].serves(Some(31)));
        fleet.leave(5, None, None);
        fleet.join(4, 10, 20, None);
        let order: Vec<ReplicaId> = fleet.members(10, 20).iter().map(|m| m.replica).collect();
        assert_eq!(order, [1, 3, 4, 7, 8, 9]);
        fleet.heard(7, 0);
        assert!(
            fleet.touch(7, 1, Some([10, 20, 30])),
            "found by binary search"
        );
        assert!(
            !fleet.touch(7, 1, Some([10, 20, 31])),
            "not under that scheme"
        );
    }

    #[test]
    fn liveness_depends_on_heartbeats() {
        let mut fleet = Fleet::default();
        fleet.heard(1, 1_000);
        fleet.heard(2, 1_000).set_heartbeats();
        // Within the timeout both are live.
        assert!(fleet.is_live(1, 5_000, 30_000, || false));
        assert!(fleet.is_live(2, 5_000, 30_000, || false));
        // Past it, a heartbeating replica is gone even if it holds entries;
        // one that never heartbeated lives on through its entries.
        assert!(!fleet.is_live(2, 40_000, 30_000, || true));
        assert!(fleet.is_live(1, 40_000, 30_000, || true));
        assert!(!fleet.is_live(1, 40_000, 30_000, || false));
    }

    #[test]
    fn stats_reset_pending_and_expiry_frees_members() {
        let mut fleet = Fleet::default();
        fleet.heard(1, 0).set_heartbeats();
        fleet.join(1, 10, 20, None);
        fleet.records.get(1).expect("a record").add_pending(500);
        assert_eq!(fleet.records.get(1).expect("a record").pending(), 500);
        fleet.record_stats(1, ReplicaStatsReport::default(), 10);
        assert_eq!(fleet.records.get(1).expect("a record").pending(), 0);
        let record = &fleet.records.get(1).expect("a record");
        record.add_assigned(1_000, 10_000);
        record.add_assigned(1_000, 10_000);
        assert!((record.assigned(1_000, 10_000) - 2.0).abs() < 1e-9);
        assert!((record.assigned(11_000, 10_000) - 1.0).abs() < 1e-9);
        assert_eq!(fleet.expire(20_000, |_| 30_000), 0);
        assert_eq!(fleet.expire(40_000, |_| 30_000), 1);
        assert!(fleet.members(10, 20).is_empty());
        assert!(fleet.memberships_of(1).is_empty());
    }

    #[test]
    fn a_flood_of_members_leaves_no_room_behind() {
        let mut fleet = Fleet::default();
        for r in 0..10_000 {
            fleet.heard(r, 0);
            fleet.join(r, r, 1, None);
        }
        fleet.join(0, 7, 7, None);
        assert_eq!(fleet.memberships_of(0), vec![[0, 1], [7, 7]]);
        for r in 0..10_000 {
            assert_eq!(fleet.leave(r, None, None), if r == 0 { 2 } else { 1 });
        }
        assert!(fleet.records.is_empty() && fleet.members.is_empty() && fleet.pairs.is_empty());
        fleet.shrink();
        assert!(fleet.records.room() < 1_000, "{}", fleet.records.room());
        assert!(fleet.members.capacity() < 1_000 && fleet.pairs.capacity() < 1_000);
    }
}
