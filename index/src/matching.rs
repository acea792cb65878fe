//! The match step: a request's chain (or exact key) in one partition →
//! every holder of its leading blocks, with the length, tokens, oldest
//! last-seen and coldest tier of its leading run, sorted by replica id.
//! This is the narrow interface between the store and the ranking: it
//! reads the store through a lock-free [`Reader`] and knows nothing of
//! policy, liveness, loads or names ([`CacheIndex::match_chain`] exposes
//! it alone).
//!
//! Cost: one key-table probe per run the request passes through, then a
//! few compares against the run's hash array (its last block the request
//! shares, and where that differs a bisection; see `Body::follow`) and, per
//! candidate, one prefix word and one cell for the stretch it holds (a pass
//! over its cells only past what the prefix word covers); candidates and
//! rows are both sorted by replica id, so following a run is one merge.
//! Candidates live in a stack buffer. Each run's dependent misses are
//! started a stage ahead (see [`walk_chain`]).

use smallvec::SmallVec;

use crate::catalog::{PartitionId, ReplicaId};
use crate::cost::MemberCost;
use crate::index::CacheIndex;
use crate::messages::{BlockHashes, Chain};
use crate::store::{Ahead, Key, Reader, Stretch};

/// Candidates (and the ranking's per-candidate buffers) kept on the stack.
pub(crate) const INLINE: usize = 16;

/// A holder of the request's first block and how far its leading run goes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Candidate {
    pub replica: ReplicaId,
    pub matched: i64,
    pub blocks: u32,
    pub oldest_seen: u32,
    pub tier: u8,
    /// Still following the request: it held every block passed so far.
    active: bool,
    /// Its place in the lookup's serving set (set by the liveness check).
    pub member: u32,
}

/// Candidates on the stack, spilling to the heap past [`INLINE`] (the
/// inline room is not cleared up front).
pub(crate) struct Candidates {
    list: SmallVec<[Candidate; INLINE]>,
}

impl Candidates {
    pub(crate) fn new() -> Self {
        Self {
            list: SmallVec::new(),
        }
    }

    /// Room for `n` candidates without growing one at a time.
    fn reserve(&mut self, n: usize) {
        if n > INLINE {
            self.list.reserve(n);
        }
    }

    fn push(&mut self, c: Candidate) {
        self.list.push(c);
    }

    fn as_mut_slice(&mut self) -> &mut [Candidate] {
        &mut self.list
    }

    /// Keeps the candidates that are live members of `serving`, each with
    /// its place there (so the ranking finds its member without a search).
    /// Both are sorted by replica id (candidates come from rows, which are),
    /// so this is one merge pass.
    pub(crate) fn retain_live(&mut self, serving: &[MemberCost<'_>]) {
        let list = self.list.as_mut_slice();
        // Where every live member holds the first block (a prompt shared
        // by the fleet), each candidate's place is its own.
        if list.len() == serving.len()
            && list
                .iter()
                .zip(serving)
                .all(|(c, l)| c.replica == l.replica)
        {
            for (i, c) in list.iter_mut().enumerate() {
                c.member = i as u32;
            }
            return;
        }
        let (mut rest, mut at, mut kept) = (serving, 0, 0);
        for i in 0..list.len() {
            let replica = list[i].replica;
            while let [first, tail @ ..] = rest
                && first.replica < replica
            {
                (rest, at) = (tail, at + 1);
            }
            if let [first, ..] = rest
                && first.replica == replica
            {
                list[i].member = at as u32;
                if kept < i {
                    list[kept] = list[i];
                }
                kept += 1;
            }
        }
        self.list.truncate(kept);
    }

    pub(crate) fn as_slice(&self) -> &[Candidate] {
        &self.list
    }
}

/// How the matching step ended.
pub(crate) enum Matched {
    /// Replicas hold a leading part of the prompt.
    Hits,
    /// Nobody holds the first block / the exact key.
    Miss,
}

impl CacheIndex {
    pub(crate) fn match_exact(
        &self,
        part: PartitionId,
        prefix_hash: &[u8],
        request_tokens: u32,
        cands: &mut Candidates,
    ) -> Matched {
        let reader = self.store.reader();
        let Some((body, pos)) = reader.locate(part, &Key::of_bytes(part, prefix_hash)) else {
            return Matched::Miss;
        };
        let stored = body.count(pos);
        let tokens = if stored > 0 {
            i64::from(stored)
        } else {
            i64::from(request_tokens)
        };
        for row in 0..body.row_count() {
            let cell = body.cell(row, pos);
            if cell.held() {
                cands.push(Candidate {
                    replica: body.replica(row),
                    matched: tokens,
                    blocks: 1,
                    oldest_seen: cell.last_seen(),
                    tier: cell.tier(),
                    active: true,
                    member: 0,
                });
            }
        }
        if cands.as_slice().is_empty() {
            Matched::Miss
        } else {
            Matched::Hits
        }
    }
}

/// Matches a chain in a partition: every holder of block 0 becomes a
/// candidate with the length, tokens, oldest last-seen and coldest tier
/// of its leading run of held blocks. Lock-free; see the `store` module.
/// `leaving` says where the request likely leaves the first run, whose
/// key-table slots the caller asked for (see [`Leaving::of`]).
/// `may_end` hears, run by run, the blocks where the match may end: as
/// each run is entered, where the request would leave it (its end, where a
/// conversation's cached turns stop), and once it is compared, how many
/// leading blocks of the request the runs passed so far hold (at least
/// one), before their cells are read.
pub(crate) fn walk_chain<'c>(
    reader: &Reader<'_>,
    part: PartitionId,
    chain: Chain<'c>,
    mut leaving: Leaving<'c>,
    cands: &mut Candidates,
    mut may_end: impl FnMut(usize),
) -> Matched {
    let n = chain.hashes.len();
    // Each run's dependent misses (key-table slot, directory slot, body and
    // data) are started a stage apart: where the request likely leaves a
    // run, its table slots when the run is entered, their directory slots
    // as the run's compares start, the next run's body once the request's
    // way out is known, before this run's cells are read.
    let touch_leaving = |leaving: &Leaving<'_>| {
        for key in leaving.keys.iter().flatten() {
            reader.touch_slot(key);
        }
    };
    touch_leaving(&leaving);
    let Some((mut body, mut pos)) = reader.locate(part, &Key::new(part, chain.hashes.hash(0)))
    else {
        return Matched::Miss;
    };
    let mut i = 0;
    loop {
        if i > 0 {
            touch_leaving(&leaving);
        }
        // Start the misses on the candidates' cells now, so they overlap
        // the compares below (a later run had them started when it was
        // found).
        let len = body.len();
        if i == 0 {
            body.touch_cells(pos, leaving.branch, n - i);
        }
        // A request that follows this run to its end goes on at block
        // `end`: start that block's key-table miss now, so that it overlaps
        // the compares (a long prompt crosses a run end every 64 blocks; a
        // request that branches off earlier wastes one prefetch), unless
        // the run's hint named the same block and it is under way.
        let end = i + (len - pos);
        if end < n && end != leaving.end {
            reader.touch(&Key::new(part, chain.hashes.hash(end)));
        }
        // How far the request follows this run: a few compares (see
        // `Body::follow`).
        let m = body.follow(pos, len, &chain.hashes, i, leaving.branch);
        may_end(i + m);
        // Where the request leaves the run it continues through another
        // one: start that run's body and first data line now (its key-table
        // slot was asked for above), so their misses are under way while
        // the cells here are read (their lines were asked for before the
        // compares); it is located after.
        let next_key = (i + m < n).then(|| Key::new(part, chain.hashes.hash(i + m)));
        if let Some(key) = &next_key {
            // And the key-table misses where the request would leave that
            // run.
            leaving = Leaving::of(reader, part, &chain.hashes, i + m, reader.touch_run(key));
            if leaving.end > 0 {
                may_end(leaving.end.min(n));
            }
        }
        // The stretch's tokens: most holders hold all of it, the others
        // sum their part.
        let tokens = Tokens::of(chain, i, i + m);
        let mut any = false;
        let rows = body.rows();
        if i == 0 {
            cands.reserve(rows.len());
            for &row in rows {
                let mut c = Candidate {
                    replica: row.replica,
                    matched: 0,
                    blocks: 0,
                    oldest_seen: u32::MAX,
                    tier: 0,
                    active: true,
                    member: 0,
                };
                extend(&mut c, body.row_stretch(row, pos, pos + m), &tokens);
                if c.blocks > 0 {
                    any |= c.active;
                    cands.push(c);
                }
            }
            if cands.as_slice().is_empty() {
                return Matched::Miss;
            }
        } else {
            // Candidates and rows are both sorted by replica id: one merge.
            let mut at = 0;
            for c in cands.as_mut_slice().iter_mut().filter(|c| c.active) {
                while at < rows.len() && rows[at].replica < c.replica {
                    at += 1;
                }
                match rows.get(at).filter(|r| r.replica == c.replica) {
                    Some(&row) => {
                        at += 1;
                        extend(c, body.row_stretch(row, pos, pos + m), &tokens);
                        any |= c.active;
                    }
                    None => c.active = false,
                }
            }
        }
        i += m;
        let next = next_key
            .filter(|_| any)
            .and_then(|key| reader.locate(part, &key));
        match next {
            Some((b, p)) => {
                b.touch_cells(p, leaving.branch, n - i);
                (body, pos) = (b, p);
            }
            None => return Matched::Hits,
        }
    }
}

/// Where a request that reached a run is likely to leave it (by [`Ahead`],
/// the run's hint): the keys of those blocks, their key-table misses
/// started, how many blocks on its last known branch is, and at which of
/// the request's blocks the hint says the run ends.
#[derive(Clone, Copy)]
pub(crate) struct Leaving<'c> {
    keys: [Option<Key<'c>>; 2],
    /// Blocks from where the request reached the run to its branch (0:
    /// none known).
    branch: usize,
    /// The request's block just past the run's end (0: none known).
    end: usize,
}

impl<'c> Leaving<'c> {
    pub(crate) const NONE: Self = Self {
        keys: [None, None],
        branch: 0,
        end: 0,
    };

    /// For a request that reached a run at its block `at`.
    pub(crate) fn of(
        reader: &Reader<'_>,
        part: PartitionId,
        hashes: &'c BlockHashes,
        at: usize,
        ahead: Ahead<'_>,
    ) -> Self {
        // Each block's key-table slot, and when the run names the run that
        // block begins in its branch table, that run's lines too.
        let keys = [ahead.branch, ahead.end].map(|k| {
            let block = at + k;
            (k > 0 && block < hashes.len()).then(|| {
                let key = Key::new(part, hashes.hash(block));
                reader.touch(&key);
                reader.touch_next(&ahead, &key);
                key
            })
        });
        Self {
            keys,
            branch: ahead.branch,
            end: if ahead.end > 0 { at + ahead.end } else { 0 },
        }
    }
}

/// The request's tokens over one stretch of a run: its total, which most
/// holders hold all of, and the tokens of a leading part of it.
struct Tokens<'a> {
    chain: Chain<'a>,
    from: usize,
    blocks: usize,
    total: i64,
}

impl<'a> Tokens<'a> {
    /// Blocks `from..to` of `chain`.
    fn of(chain: Chain<'a>, from: usize, to: usize) -> Self {
        Self {
            chain,
            from,
            blocks: to - from,
            total: chain.token_total(from, to),
        }
    }

    /// Tokens of the stretch's first `k` blocks.
    fn first(&self, k: usize) -> i64 {
        if k == self.blocks {
            self.total
        } else {
            self.chain.token_total(self.from, self.from + k)
        }
    }
}

/// Extends a candidate's leading run over a held stretch of its row.
fn extend(c: &mut Candidate, stretch: Stretch, tokens: &Tokens<'_>) {
    let k = stretch.blocks;
    if stretch.ended {
        c.active = false;
    }
    if k > 0 {
        c.oldest_seen = c.oldest_seen.min(stretch.oldest);
        c.tier = c.tier.max(stretch.tier);
    }
    c.matched += tokens.first(k);
    c.blocks += k as u32;
}
