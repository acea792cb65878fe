//! Cost-aware ranking (`spec.ranker: CostAware`): send a request where it
//! will wait least, and let requests with nothing distinguishing spread.
//!
//! For every live member `r` of the serving set (see the `fleet` module):
//!
//! ```text
//! uncached(r) = request tokens − tokens of the request r already holds
//! load(r)     = queued(r) + pending(r)                       (prefill tokens)
//! queued(r)   = tokens(waiting) + runningWeight × tokens(running), from r's
//!               last stats if younger than loadStatsMaxAge; unknown
//!               otherwise → the mean of the members whose load is known
//! tokens(n)   = uncached tokens of the n requests this index hinted to r
//!               last before those stats (its queue is FIFO: the waiting
//!               ones are the latest, the running ones came before them);
//!               mean request tokens for each it did not send or no longer
//!               remembers (it keeps the last 32)
//! pending(r)  = uncached tokens this index hinted to r since those stats
//! excess(r)   = recent(r) past its bound, × mean request tokens
//!               × continuationWeight when the request continues a
//!               conversation (recent: a decayed count, see below)
//! bound       = mean recent requests          for a new session
//!               loadBound × that mean + 1     for a continuation
//!               that mean + 1                 with no distinguishing match
//! busy        = mean load / mean request tokens (queued requests per member)
//! full(r)     = r's recent evictions / its recent stores, at most 1
//! cost(r)     = (1 + contentionWeight × busy + fullCacheWeight × full(r))
//!               × uncached(r) + loadWeight × (load(r) + excess(r))
//! ```
//!
//! The mean request tokens are a running mean of the uncached tokens of the
//! requests hinted, kept by each thread over the requests it hinted
//! ([`RequestTokenMeans`]).
//!
//! The contention factor makes recomputation dearer as the fleet fills up:
//! moving a session off its cache adds work that everything queued behind
//! it waits for, so a saturated fleet keeps sessions where their cache is.
//! The excess term keeps long-lived sessions from piling onto a few
//! replicas when nothing else would move them (an idle fleet). Moving a
//! conversation mid-way recomputes its whole context, while a request that
//! starts from a shared prefix (a new session on a tool preamble) copies
//! only that prefix, and copying it once lets later sessions spread. The two
//! are told apart by where the request's deepest match ends: at a block where
//! at least [`BRANCH_POINT_REQUESTS`] earlier requests' matches also ended (a
//! branch point: shared) or not (the end of this conversation's previous
//! turn, or a fork of it by a few parallel tool calls). [`ReuseCounts`] keeps
//! those counts. A new session feels every request its member took above
//! the mean (sessions are the unit that balances: a replica ahead gets no
//! new ones until the others catch up), a continuation only those past the
//! `loadBound`, and at `continuationWeight`.
//!
//! The full-cache factor weighs duplication: a member whose every stored
//! block evicts one (its producer reports as many evictions as stores) pays
//! for a copied prefix with blocks later requests would have reused, so
//! where caches are small a session stays with the holder of its prefix.
//! Stores and evictions are counted per replica as the index applies them,
//! halving every minute.
//!
//! The *common depth* is the longest run of blocks that more than half of the
//! live members hold (a system prompt, a tool preamble): holding it tells
//! nothing about where a request belongs. The pick is the member of least
//! cost. It is a PREFIX_MATCH when that member holds at least
//! `minimumMatchedTokens` beyond the common depth (and that many tokens ×
//! freshness reach `routingFloorScore`); the answer lists every live holder
//! past the floor by increasing cost, with `score = tokens / (tokens + cost)`.
//! Otherwise nothing distinguishes a member, and the request goes by
//! rendezvous hashing of its first block past the common depth — the first
//! block of the session's own content, the same on every turn — over the
//! members whose cost is within `(loadBound − 1) × max(request, mean
//! request)` tokens of the least and whose recent requests (a count halving
//! every `balanceHalfLife`) are at most `loadBound × their mean + 1`:
//! deterministic, even even when every replica is idle, and bounded by load
//! (AFFINITY_HINT, or NO_HINT when affinity routing is disabled).
//!
//! Cost: two passes over the live members (each candidate knows its
//! member's place, from the liveness check); the answer's order is a sort
//! of integer keys (a name's place comes from the catalog's order key, so
//! ties never compare strings); everything lives in stack buffers of 32
//! members (heap beyond).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

use smallvec::SmallVec;

use crate::catalog::{Catalog, ReplicaId};
use crate::fleet::{Fleet, ReplicaRecord};
use crate::index::CacheIndex;
use crate::lookup::{Ctx, Ranked};
use crate::matching::Candidate;
use crate::messages::{Chain, Decision, ReplicaScore, Tier};
use crate::policy::CachePolicy;
use crate::store::HashRef;

/// Queued requests a fully pressured replica stands for when its producer
/// reports `pressure` but no request counts.
const PRESSURE_REQUESTS: f64 = 8.0;
/// Requests whose deepest match ended at one block before it counts as a
/// branch point (a shared template) rather than the end of a conversation's
/// last turn. Above one, so that the few parallel requests of one agent step
/// (tool calls forking one conversation) still count as a continuation: moving
/// them recomputes the whole conversation.
const BRANCH_POINT_REQUESTS: u32 = 5;
/// Weight of a new observation in the running mean of request tokens.
const MEAN_ALPHA: f64 = 0.05;

/// A live member of a lookup's serving set, as the cost ranker sees it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MemberCost<'f> {
    pub replica: ReplicaId,
    /// Its fleet record, read once: by the liveness check, then for its
    /// load and the hinted prefill.
    pub record: Option<&'f ReplicaRecord>,
    /// Prefill tokens queued there.
    pub load: f64,
    /// Whether its queue is known from recent stats (else `load` adds the
    /// mean of the members whose queue is).
    pub load_known: bool,
    /// Requests hinted there recently (decayed count).
    pub assigned: f64,
    /// Tokens of the request it holds.
    pub matched: i64,
    /// Blocks of the request it holds.
    pub blocks: u32,
    pub oldest_seen: u32,
    pub tier: u8,
    /// How full its cache runs (see `ReplicaRecord::churn`).
    pub churn: f64,
    pub cost: f64,
    /// Its name's place among the replicas' (`Catalog::replica_order`).
    pub order: u64,
}

/// Whether a lookup's members have their loads: read at most once, into
/// the serving set itself, and shared by the ranking and the fallback.
pub(crate) struct MemberLoads {
    read: bool,
}

impl MemberLoads {
    pub(crate) fn new() -> Self {
        Self { read: false }
    }

    /// The members, their loads read on first use.
    pub(crate) fn get<'m, 'f>(
        &mut self,
        index: &CacheIndex,
        ctx: &Ctx<'_>,
        members: &'m mut [MemberCost<'f>],
    ) -> &'m mut [MemberCost<'f>] {
        if !self.read {
            index.member_loads(ctx, members);
            self.read = true;
        }
        members
    }
}

/// The running means of request tokens: one per thread (up to this many;
/// threads past it share). One mean that every lookup wrote was a cache
/// line the cores passed between them (`docs/performance.md`, "Lookups
/// beside other threads"). Each thread's mean follows the requests it
/// hinted, which come from the same traffic as every other thread's.
pub(crate) struct RequestTokenMeans {
    means: [CachePadded<AtomicU64>; MEAN_STRIPES],
    /// Whether any mean has ever left 0: until then a thread whose own mean
    /// is 0 has no other to look at. Written once.
    any: CachePadded<AtomicBool>,
}

const MEAN_STRIPES: usize = 16;

impl Default for RequestTokenMeans {
    fn default() -> Self {
        Self {
            means: std::array::from_fn(|_| CachePadded::new(AtomicU64::new(0))),
            any: CachePadded::new(AtomicBool::new(false)),
        }
    }
}

impl RequestTokenMeans {
    /// This thread's mean.
    fn own(&self) -> &AtomicU64 {
        &self.means[mean_stripe()]
    }

    /// The mean: this thread's, or for a thread that has hinted nothing
    /// yet another thread's (0 before any request was hinted). While every
    /// mean is 0 (so far each hinted request was wholly cached) the others
    /// are not scanned: 16 lines read on each of a lookup's three calls
    /// were about 240 of its instructions.
    fn get(&self) -> f64 {
        let own = f64::from_bits(self.own().load(Ordering::Relaxed));
        if own > 0.0 || !self.any.load(Ordering::Relaxed) {
            return own;
        }
        self.means
            .iter()
            .map(|m| f64::from_bits(m.load(Ordering::Relaxed)))
            .find(|&m| m > 0.0)
            .unwrap_or(0.0)
    }

    /// Folds one hinted request's tokens into this thread's mean.
    fn observe(&self, tokens: f64) {
        let mean = self.get();
        let next = if mean <= 0.0 {
            tokens
        } else {
            mean + MEAN_ALPHA * (tokens - mean)
        };
        self.own().store(next.to_bits(), Ordering::Relaxed);
        if next > 0.0 && !self.any.load(Ordering::Relaxed) {
            self.any.store(true, Ordering::Relaxed);
        }
    }
}

/// This thread's place among the means.
fn mean_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % MEAN_STRIPES;
    }
    STRIPE.with(|s| *s)
}

impl CacheIndex {
    /// Folds one hinted request's uncached tokens into the running mean.
    pub(crate) fn observe_request_tokens(&self, tokens: f64) {
        self.mean_request_tokens.observe(tokens);
    }

    /// Running mean of the uncached tokens of hinted requests (this
    /// thread's, see [`RequestTokenMeans`]).
    pub(crate) fn mean_request_tokens(&self) -> f64 {
        self.mean_request_tokens.get()
    }

    /// Load of every live member, in prefill tokens (see the module notes).
    fn member_loads(&self, ctx: &Ctx<'_>, members: &mut [MemberCost<'_>]) {
        let policy = ctx.policy;
        let mean_tokens = self.mean_request_tokens();
        let max_age_ms = u64::try_from(policy.load_stats_max_age.as_millis()).unwrap_or(u64::MAX);
        let half_life_ms = u64::try_from(policy.balance_half_life.as_millis()).unwrap_or(u64::MAX);
        let (mut known_sum, mut known) = (0.0, 0u32);
        for m in members.iter_mut() {
            let record = m.record;
            let queued = record.and_then(|r| {
                let stats = r.stats.get()?;
                (ctx.now_ms.saturating_sub(stats.at_ms) <= max_age_ms).then(|| {
                    let (waiting, running) = (
                        u64::from(stats.requests_waiting),
                        u64::from(stats.requests_running),
                    );
                    if waiting == 0 && running == 0 {
                        return PRESSURE_REQUESTS
                            * f64::from(stats.pressure).clamp(0.0, 1.0)
                            * mean_tokens;
                    }
                    // The requests it reports are the last ones hinted to it
                    // (FIFO); those this index did not send, or no longer
                    // remembers, count as a mean request.
                    let queued_tokens = |skip: u64, count: u64| {
                        let (tokens, known) = r.hinted_before_stats(skip, count);
                        tokens as f64 + (count - known) as f64 * mean_tokens
                    };
                    queued_tokens(0, waiting)
                        + policy.running_weight * queued_tokens(waiting, running)
                })
            });
            if let Some(q) = queued {
                known_sum += q;
                known += 1;
            }
            m.load = queued.unwrap_or(0.0) + record.map_or(0, |r| r.pending()) as f64;
            m.load_known = queued.is_some();
            m.assigned = record.map_or(0.0, |r| r.assigned(ctx.now_ms, half_life_ms));
            m.churn = record.map_or(0.0, |r| r.churn(ctx.now_ms));
        }
        // A member whose load is unknown counts the mean of the known ones.
        if known > 0 && (known as usize) < members.len() {
            let typical = known_sum / f64::from(known);
            for m in members.iter_mut().filter(|m| !m.load_known) {
                m.load += typical;
            }
        }
    }
}

/// Whether a request continues one conversation or starts a session from a
/// shared prefix (or from nothing): moving the first recomputes its whole
/// context, moving the second copies a shared prefix once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestKind {
    Continuation,
    NewSession,
    /// Nothing distinguishing matched: rendezvous hashing places it, and the
    /// balance bound keeps every member it could land on eligible.
    Unmatched,
}

/// Where the least-cost member is and where the common depth ends (the
/// members themselves get their match and cost filled in, in place).
struct CostView {
    /// Index of the least-cost member.
    best: usize,
    common_blocks: usize,
    common_tokens: i64,
}

fn cost_view(
    policy: &CachePolicy,
    members: &mut [MemberCost<'_>],
    cands: &[Candidate],
    chain: Option<Chain<'_>>,
    request_tokens: i64,
    mean_tokens: f64,
    kind: RequestKind,
) -> Option<CostView> {
    if members.is_empty() {
        return None;
    }
    // Every candidate is a member and knows its place among them (the
    // members are the serving set's, in its order).
    for c in cands {
        let m = &mut members[c.member as usize];
        debug_assert_eq!(m.replica, c.replica, "a candidate's member");
        m.matched = c.matched;
        m.blocks = c.blocks;
        m.oldest_seen = c.oldest_seen;
        m.tier = c.tier;
    }
    // Recent requests past the balance bound count as queued requests (see
    // the module notes).
    let n = members.len() as f64;
    let (assigned_sum, load_sum) = members
        .iter()
        .fold((0.0, 0.0), |(a, l), m| (a + m.assigned, l + m.load));
    let mean_assigned = assigned_sum / n;
    let (assigned_limit, excess_weight) = match kind {
        RequestKind::NewSession => (mean_assigned, 1.0),
        RequestKind::Continuation => (
            policy.load_bound * mean_assigned + 1.0,
            policy.continuation_weight,
        ),
        RequestKind::Unmatched => (mean_assigned + 1.0, 1.0),
    };
    // Recomputing a prefix is work every request queued behind it waits
    // for: the busier the fleet, the more an uncached token costs.
    let mean_load = load_sum / n;
    let busy = if mean_tokens > 0.0 {
        mean_load / mean_tokens
    } else {
        0.0
    };
    let uncached_weight = 1.0 + policy.contention_weight * busy;
    let excess_scale = mean_tokens * excess_weight;
    let mut best = 0;
    let (mut best_cost, mut best_matched) = (f64::INFINITY, i64::MIN);
    for (i, m) in members.iter_mut().enumerate() {
        let excess = (m.assigned - assigned_limit).max(0.0) * excess_scale;
        let uncached = (request_tokens - m.matched).max(0) as f64;
        let weight = uncached_weight + policy.full_cache_weight * m.churn;
        m.cost = weight * uncached + policy.load_weight * (m.load + excess);
        if i == 0 || m.cost < best_cost || (m.cost == best_cost && m.matched > best_matched) {
            (best, best_cost, best_matched) = (i, m.cost, m.matched);
        }
    }
    // Common depth: the (⌊n/2⌋+1)-th largest held run (none for a lone
    // member, whose match always distinguishes it). Members that are not
    // candidates hold nothing, so with fewer candidates than that rank it
    // is zero, and otherwise it is a rank among the candidates' runs.
    let rank = members.len() / 2;
    let common_blocks = if members.len() < 2 || cands.len() <= rank {
        0
    } else {
        let mut runs: SmallVec<[u32; 32]> = SmallVec::new();
        runs.extend(cands.iter().map(|c| c.blocks));
        // Only the one rank is needed, not the whole order.
        let (_, &mut at, _) = runs.select_nth_unstable_by(rank, |a, b| b.cmp(a));
        at as usize
    };
    let common_tokens = chain.map_or(0, |c| c.token_total(0, common_blocks));
    Some(CostView {
        best,
        common_blocks,
        common_tokens,
    })
}

/// PREFIX_MATCH by least cost, or a downgrade seeded past the common depth.
/// The members get this request's match and cost filled in, in place (the
/// fallback fills them in again from the same candidates).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rank_by_cost(
    ctx: &Ctx<'_>,
    fleet: &Fleet,
    members: &mut [MemberCost<'_>],
    cands: &[Candidate],
    chain: Option<Chain<'_>>,
    request_tokens: i64,
    mean_tokens: f64,
) -> Ranked {
    let policy = ctx.policy;
    // Where the deepest match ends: a prefix other requests already branched
    // off (a shared template) or the end of one conversation's last turn.
    let deepest = cands.iter().map(|c| c.blocks).max().unwrap_or(0) as usize;
    let reused = match chain {
        Some(c) if deepest > 0 && deepest <= c.hashes.len() => {
            fleet.reuse.bump(seed_of(c.hashes.get(deepest - 1)))
        }
        _ => 1,
    };
    let kind = if reused < BRANCH_POINT_REQUESTS {
        RequestKind::Continuation
    } else {
        RequestKind::NewSession
    };
    let Some(view) = cost_view(
        policy,
        members,
        cands,
        chain,
        request_tokens,
        mean_tokens,
        kind,
    ) else {
        return Ranked::DOWNGRADED;
    };
    let best = members[view.best];
    let floor = i64::from(policy.minimum_matched_tokens).max(1);
    let distinguishing = best.matched - view.common_tokens;
    let evidence = distinguishing as f64 * ctx.freshness(best.oldest_seen);
    if distinguishing < floor || evidence < policy.routing_floor_score {
        let longest = members.iter().map(|m| m.matched).max().unwrap_or(0);
        let why = if distinguishing < floor && longest - view.common_tokens >= floor {
            // A member holds real evidence, but its cost sent the request on.
            Decision::Load
        } else if distinguishing < floor && view.common_tokens > 0 {
            Decision::SharedHead
        } else {
            Decision::BelowFloor
        };
        return Ranked::Downgraded {
            seed_block: view.common_blocks,
            why,
        };
    }
    let total = request_tokens.max(1) as f64;
    // The answer's order: members past the floor by cost, then by match,
    // then by name (ties of cost and match are common: members that hold
    // only the shared head). The sort compares integer keys, not members.
    let members = &members[..];
    // Filled in place: a collected list of 32 inline keys would be built
    // elsewhere and copied here (1 KiB).
    let mut order: SmallVec<[(u64, u64, u64, u32); 32]> = SmallVec::new();
    order.extend(
        members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.matched >= floor)
            .map(|(i, m)| {
                let matched = u64::try_from(m.matched).unwrap_or(0);
                (ordered_bits(m.cost), u64::MAX - matched, m.order, i as u32)
            }),
    );
    order.sort_unstable();
    let fresh = ctx.freshness_of();
    let scores = order
        .iter()
        .map(|&(.., i)| {
            let m = &members[i as usize];
            ReplicaScore {
                replica: m.replica,
                score: (total / (total + m.cost)) as f32,
                matched_tokens: i32::try_from(m.matched).unwrap_or(i32::MAX),
                estimated_cache_hit_prob: ((m.matched as f64 / total).min(1.0)
                    * fresh.of(m.oldest_seen)) as f32,
                tier: Tier::from_u8(m.tier),
            }
        })
        .collect();
    Ranked::Hint(crate::messages::Reason::PrefixMatch, scores)
}

/// The AFFINITY_HINT of the cost-aware ranker: rendezvous hashing of the
/// request's first block past the common depth over the members whose load
/// is within the bound. `None` when affinity routing is off or nobody serves.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bounded_affinity(
    policy: &CachePolicy,
    catalog: &Catalog,
    members: &mut [MemberCost<'_>],
    cands: &[Candidate],
    chain: Option<Chain<'_>>,
    seed_block: usize,
    prefix_hash: &[u8],
    request_tokens: i64,
    mean_tokens: f64,
) -> Option<ReplicaScore> {
    if !policy.affinity_routing {
        return None;
    }
    let view = cost_view(
        policy,
        members,
        cands,
        chain,
        request_tokens,
        mean_tokens,
        RequestKind::Unmatched,
    )?;
    let seed = match chain {
        Some(c) if !c.hashes.is_empty() => {
            seed_of(c.hashes.get(seed_block.min(c.hashes.len() - 1)))
        }
        _ if !prefix_hash.is_empty() => seed_of(prefix_hash),
        _ => return None,
    };
    let n = members.len() as f64;
    let mean_assigned = members.iter().map(|m| m.assigned).sum::<f64>() / n;
    let least = members[view.best].cost;
    let cost_limit = least + (policy.load_bound - 1.0) * (request_tokens as f64).max(mean_tokens);
    let assigned_limit = policy.load_bound * mean_assigned + 1.0;
    let rendezvous = |eligible: &dyn Fn(&MemberCost) -> bool| {
        let mut pick: Option<(u64, ReplicaId)> = None;
        for m in members.iter().filter(|m| eligible(m)) {
            let weight = mix(seed ^ name_hash(catalog.replica_str(m.replica).as_bytes()));
            if pick.is_none_or(|(w, _)| weight > w) {
                pick = Some((weight, m.replica));
            }
        }
        pick.map(|(_, r)| r)
    };
    let replica = rendezvous(&|m| m.cost <= cost_limit && m.assigned <= assigned_limit)
        .or_else(|| rendezvous(&|m| m.cost <= cost_limit))
        .or_else(|| rendezvous(&|_| true))?;
    Some(ReplicaScore {
        replica,
        score: 0.0,
        matched_tokens: 0,
        estimated_cache_hit_prob: 0.0,
        tier: Tier::Unspecified,
    })
}

/// How many requests' deepest match ended at each block: a lossy, fixed-size,
/// lock-free table (one `u64` per slot: a 48-bit tag and a 16-bit count; a
/// slot taken over by another block starts again from zero). 512 KiB per
/// index; a lookup reads and writes one slot.
#[derive(Debug)]
pub(crate) struct ReuseCounts {
    slots: Box<[AtomicU64]>,
}

const REUSE_SLOTS: usize = 1 << 16;

impl Default for ReuseCounts {
    fn default() -> Self {
        Self {
            slots: (0..REUSE_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl ReuseCounts {
    /// Starts loading the slot of the block `bytes` (a chain hash), so that
    /// a [`bump`](Self::bump) of it soon after finds it in cache.
    pub fn prefetch(&self, bytes: &[u8]) {
        crate::store::prefetch(self.slot(seed_of(bytes)).0);
    }

    fn slot(&self, hash: u64) -> (&AtomicU64, u64) {
        let h = mix(hash);
        (&self.slots[(h as usize) & (REUSE_SLOTS - 1)], h)
    }

    /// Counts one more request whose match ended at `hash`; returns how many
    /// did before.
    pub fn bump(&self, hash: u64) -> u32 {
        let (slot, h) = self.slot(hash);
        let tag = h & !0xFFFF;
        let old = slot.load(Ordering::Relaxed);
        let before = if old & !0xFFFF == tag {
            old & 0xFFFF
        } else {
            0
        };
        slot.store(tag | (before + 1).min(0xFFFF), Ordering::Relaxed);
        before as u32
    }
}

/// `x`'s bits as an unsigned key that orders as `f64::total_cmp` does.
fn ordered_bits(x: f64) -> u64 {
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

fn seed_of(bytes: &[u8]) -> u64 {
    match HashRef::from_bytes(bytes) {
        HashRef::Narrow(h) => h,
        HashRef::Wide(b) => name_hash(b),
    }
}

/// FNV-1a: replica names hash the same on every server.
fn name_hash(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A 64-bit finalizer (SplitMix64), so neighbouring seeds spread.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::{MEAN_ALPHA, RequestTokenMeans, mean_stripe, ordered_bits};

    #[test]
    fn each_thread_keeps_its_own_mean_and_a_new_one_starts_from_another() {
        let means = RequestTokenMeans::default();
        assert_eq!(means.get(), 0.0);
        means.observe(100.0);
        assert_eq!(means.get(), 100.0);
        means.observe(200.0);
        let here = 100.0 + MEAN_ALPHA * 100.0;
        assert_eq!(means.get(), here);
        let mine = mean_stripe();
        // Threads take places in turn (16 of them); find one with another.
        let there = (0..32).find_map(|_| {
            std::thread::scope(|s| {
                s.spawn(|| {
                    if mean_stripe() == mine {
                        return None;
                    }
                    // Nothing hinted here yet: the other thread's mean.
                    let before = means.get();
                    means.observe(1_000.0);
                    Some((before, means.get()))
                })
                .join()
                .expect("thread")
            })
        });
        let (before, after) = there.expect("a thread with a place of its own");
        assert_eq!(before, here);
        assert_eq!(after, here + MEAN_ALPHA * (1_000.0 - here));
        assert_eq!(
            means.get(),
            here,
            "another thread's requests moved this one's mean"
        );
    }

    #[test]
    fn ordered_bits_sort_as_total_cmp() {
        let mut values = [
            3.5,
            -0.0,
            0.0,
            f64::INFINITY,
            -2.0,
            1e-300,
            f64::MAX,
            -f64::INFINITY,
            12_345.678,
            2.0,
            -1e-300,
        ];
        let mut by_bits = values;
        values.sort_by(f64::total_cmp);
        by_bits.sort_by_key(|&x| ordered_bits(x));
        assert_eq!(values.map(f64::to_bits), by_bits.map(f64::to_bits));
    }
}
