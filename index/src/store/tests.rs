//! Unit tests of the store: ingest, lookups, removals, rebuilds and the
//! hints a reader prefetches through.

use std::sync::atomic::Ordering;

use super::body::{head_lines, lines_of, placed};
use super::data::{HEAD, Prefix};
use super::writing::Link;
use super::*;
use crate::branches::Lines;
use crate::catalog::ReplicaId;

struct Count(Vec<(PartitionId, Option<ReplicaId>)>);

impl Removed for Count {
    fn entry(&mut self, part: PartitionId, replica: ReplicaId) {
        self.0.push((part, Some(replica)));
    }
    fn key(&mut self, part: PartitionId) {
        self.0.push((part, None));
    }
}

fn holding(room: i64) -> Holding {
    Holding {
        room,
        max_holders: usize::MAX,
        ..Holding::default()
    }
}

fn claim(replica: ReplicaId, last_seen: u32) -> Claim {
    Claim {
        replica,
        last_seen,
        tier: 1,
    }
}

fn keys(part: PartitionId, range: std::ops::Range<u64>) -> Vec<(Key<'static>, u32)> {
    range
        .map(|h| (Key::new(part, HashRef::Narrow(h)), 16))
        .collect()
}

/// The body and position holding key `h` of `part`, which is stored.
fn located<'r>(reader: &'r Reader<'_>, part: PartitionId, h: u64) -> (&'r Body, usize) {
    reader
        .locate(part, &Key::new(part, HashRef::Narrow(h)))
        .expect("stored")
}

/// Held cells of `replica` along `range` as a reader sees them.
fn held(
    store: &Store,
    part: PartitionId,
    range: std::ops::Range<u64>,
    replica: ReplicaId,
) -> Vec<bool> {
    let reader = store.reader();
    range
        .map(|h| {
            let key = Key::new(part, HashRef::Narrow(h));
            reader.locate(part, &key).is_some_and(|(body, pos)| {
                body.row(replica).is_some_and(|r| body.cell(r, pos).held())
            })
        })
        .collect()
}

#[test]
fn layout_is_compact() {
    assert_eq!(std::mem::size_of::<Cell>(), 8);
    let c = Cell::new(0x1234_5678, 3, 9);
    assert_eq!(
        (c.last_seen(), c.tier(), c.access(), c.held()),
        (0x1234_5678, 3, 9, true)
    );
    assert!(!Cell::default().held());
}

#[test]
fn chains_share_runs_and_holes_are_exact() {
    let store = Store::default();
    let mut w = store.write();
    let mut h = holding(1000);
    w.hold(1, &keys(1, 0..10)[..], claim(7, 100), &mut h);
    assert_eq!((h.added, h.new_keys, h.written), (10, 10, 10));
    assert_eq!(w.shape().1, 1, "one report, one run");
    // A second holder of the head and a divergent tail.
    let mut h = holding(1000);
    let mut other = keys(1, 0..4);
    other.extend(keys(1, 100..104));
    w.hold(1, &other[..], claim(3, 101), &mut h);
    assert_eq!((h.added, h.new_keys), (8, 4));
    assert_eq!(w.shape(), (14, 2, w.shape().2));
    // A refresh adds nothing.
    let mut h = holding(0);
    w.hold(1, &keys(1, 0..10)[..], claim(7, 102), &mut h);
    assert_eq!((h.added, h.refused, h.written), (0, 0, 10));
    // A hole in the middle.
    assert_eq!(
        w.release(1, &Key::new(1, HashRef::Narrow(5)), 7),
        (true, true)
    );
    assert_eq!(
        w.release(1, &Key::new(1, HashRef::Narrow(5)), 7),
        (false, false)
    );
    assert_eq!(w.entries(), 17);
    drop(w);
    let mut expect = vec![true; 10];
    expect[5] = false;
    assert_eq!(held(&store, 1, 0..10, 7), expect);
    assert_eq!(
        held(&store, 1, 0..10, 3)[..5],
        [true, true, true, true, false]
    );
    assert_eq!(
        held(&store, 2, 0..10, 7),
        vec![false; 10],
        "partitions are apart"
    );
}

/// Pins and unpins on another thread until every batch the writer
/// retired is marked done (the epoch moved past every earlier pin), as
/// lookups on other threads would; false if that does not happen
/// `within` (the epoch is the process's: a test on another thread that
/// is pinned holds it up for as long).
fn others_pass_the_epoch(store: &Store, within: std::time::Duration) -> bool {
    let all_done = || {
        let w = store.writer.lock();
        !w.retired.is_empty() && w.retired.iter().all(|b| b.done.load(Ordering::Acquire))
    };
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let deadline = std::time::Instant::now() + within;
                while std::time::Instant::now() < deadline {
                    if all_done() {
                        return true;
                    }
                    epoch::pin().flush();
                    std::thread::yield_now();
                }
                false
            })
            .join()
            .expect("pinning thread")
    })
}

/// The current body of the run holding key `h` of `part`, weakly.
fn body_of(store: &Store, part: PartitionId, h: u64) -> std::sync::Weak<Body> {
    let w = store.write();
    let (run, _) = w
        .locate(part, &Key::new(part, HashRef::Narrow(h)))
        .expect("stored");
    Arc::downgrade(w.body(run).expect("a body"))
}

/// With no reader pinned any more: lookups' threads pass the epoch and
/// mark `old`'s batch done without dropping it, and the next write
/// frees it.
fn freed_by_the_next_write<T>(store: &Store, old: &std::sync::Weak<T>) {
    assert!(
        others_pass_the_epoch(store, std::time::Duration::from_secs(20)),
        "the epoch moves on"
    );
    assert!(old.upgrade().is_some(), "not freed on a reader's thread");
    drop(store.write());
    assert!(old.upgrade().is_none(), "freed by the writer");
}

#[test]
fn a_body_a_reader_holds_is_freed_by_the_writer_not_the_reader() {
    let store = Store::default();
    let mut w = store.write();
    w.hold(1, &keys(1, 0..8)[..], claim(7, 100), &mut holding(1000));
    drop(w);
    let old = body_of(&store, 1, 0);
    let reader = store.reader();
    let (held, _) = located(&reader, 1, 0);
    // A second holder needs a row the run has no room for: a new body.
    let mut w = store.write();
    w.hold(1, &keys(1, 0..8)[..], claim(9, 100), &mut holding(1000));
    w.hand_to_epoch();
    drop(w);
    // However much the others pin and the writer writes, the body this
    // reader holds stays whole while it is pinned.
    assert!(
        !others_pass_the_epoch(&store, std::time::Duration::from_millis(50)),
        "the reader's pin holds the epoch"
    );
    for _ in 0..100 {
        drop(store.write());
        epoch::pin().flush();
    }
    assert!(old.upgrade().is_some(), "the reader's body waits");
    assert_eq!(held.len(), 8);
    let row = held.row(7).expect("the first holder's row");
    assert!(held.cell(row, 0).held(), "still readable");
    drop(reader);
    freed_by_the_next_write(&store, &old);
    // A freed run's body goes the same way.
    let old = body_of(&store, 1, 0);
    let reader = store.reader();
    let (held, _) = located(&reader, 1, 0);
    let mut w = store.write();
    let mut count = Count(Vec::new());
    w.clear(7, |_| true, &mut count);
    w.clear(9, |_| true, &mut count);
    assert_eq!(w.shape().1, 0, "the run is freed");
    w.hand_to_epoch();
    drop(w);
    assert!(old.upgrade().is_some(), "the reader's body waits");
    assert_eq!(held.len(), 8);
    drop(reader);
    freed_by_the_next_write(&store, &old);
}

#[test]
fn an_outgrown_key_table_a_reader_holds_waits_for_it() {
    let store = Store::default();
    let reader = store.reader();
    let old = Arc::downgrade(&store.writer.lock().table);
    let held = reader.table();
    let before = held.bytes();
    // Enough new blocks to grow the table several times.
    let mut w = store.write();
    for start in (0..4096u64).step_by(64) {
        w.hold(
            1,
            &keys(1, start..start + 64)[..],
            claim(7, 100),
            &mut holding(1 << 20),
        );
    }
    drop(w);
    assert!(store.write().w.table.bytes() > before, "the table grew");
    assert!(old.upgrade().is_some(), "the reader's table waits");
    assert_eq!(held.bytes(), before, "and still reads whole");
    assert!(
        reader.table().bytes() > before,
        "a new load sees the new one"
    );
    drop(reader);
    freed_by_the_next_write(&store, &old);
    let reader = store.reader();
    assert!(reader.locate(1, &keys(1, 4095..4096)[0].0).is_some());
}

#[test]
fn a_request_follows_a_run_exactly_as_far_as_its_hashes_agree() {
    let store = Store::default();
    let mut w = store.write();
    w.hold(1, &keys(1, 0..64)[..], claim(7, 100), &mut holding(1000));
    drop(w);
    let reader = store.reader();
    for from in [0u64, 1, 3, 17, 60] {
        let (body, pos) = located(&reader, 1, from);
        let len = body.len();
        for agree in 1..=(64 - from as usize) {
            // Two blocks of the request before the run's, then `agree` of
            // the run's, then blocks of another branch (parent-chained
            // hashes never meet the run again), as many as the run has
            // left or fewer.
            for after in [0, 1, 5, 64] {
                let mut hashes: Vec<Vec<u8>> = vec![999u64.to_be_bytes().to_vec(); 2];
                hashes.extend((from..from + agree as u64).map(|h| h.to_be_bytes().to_vec()));
                hashes.extend((0..after).map(|k| (5_000u64 + k).to_be_bytes().to_vec()));
                let chain =
                    crate::BlockChain::new(&hashes, vec![16; hashes.len()]).expect("a chain");
                // Whatever earlier requests did: a right guess, a wrong
                // one either side, none, one past the run.
                for leave in [0, 1, agree, agree.saturating_sub(3), agree + 2, 70] {
                    let followed = body.follow(pos, len, &chain.hashes, 2, leave);
                    assert_eq!(
                        followed, agree,
                        "from {from}, agreeing for {agree}, {after} after, leave {leave}"
                    );
                }
            }
        }
    }
}

/// Length of `replica`'s prefix word in the run holding key `h`.
fn prefix_len(store: &Store, part: PartitionId, h: u64, replica: ReplicaId) -> usize {
    let reader = store.reader();
    let (body, _) = located(&reader, part, h);
    let slot = body.rows[body.row(replica).expect("a row")].slot as usize;
    Prefix(body.data.prefix(slot).load(Ordering::Relaxed)).len()
}

/// Replica 7 reports blocks `range` of `part`, seen at `seen`.
fn report_7(store: &Store, part: PartitionId, range: std::ops::Range<u64>, seen: u32) {
    store.write().hold(
        part,
        &keys(part, range)[..],
        claim(7, seen),
        &mut holding(1000),
    );
}

/// Replica 7's stretch over positions `from..to` of the run holding key
/// 0 of `part`, asserting that reading it through the prefix word and
/// cell by cell agree; its blocks and oldest second.
fn stretch_7(store: &Store, part: PartitionId, from: usize, to: usize) -> (usize, u32) {
    let reader = store.reader();
    let (body, pos) = located(&reader, part, 0);
    let row = body.rows()[body.row(7).expect("a row")];
    let fast = body.row_stretch(row, pos + from, pos + to);
    let slow = body.scan_stretch(row.slot as usize, pos + from, pos + to);
    assert_eq!(
        (fast.blocks, fast.oldest, fast.tier, fast.ended),
        (slow.blocks, slow.oldest, slow.tier, slow.ended),
        "{from}..{to}: through the word and cell by cell"
    );
    (fast.blocks, fast.oldest)
}

#[test]
fn prefix_words_cover_what_reports_wrote_in_order() {
    let store = Store::default();
    report_7(&store, 1, 0..64, 100);
    assert_eq!(prefix_len(&store, 1, 0, 7), 64, "one report in order");
    // A later refresh of the middle: the blocks after it are older.
    report_7(&store, 1, 10..20, 105);
    assert_eq!(prefix_len(&store, 1, 0, 7), 20);
    // A refresh of the whole chain in order covers it all again.
    report_7(&store, 1, 0..64, 110);
    assert_eq!(prefix_len(&store, 1, 0, 7), 64);
    // A hole ends it; a colder tier too.
    store
        .write()
        .release(1, &Key::new(1, HashRef::Narrow(30)), 7);
    assert_eq!(prefix_len(&store, 1, 0, 7), 30);
    let cold = Claim {
        tier: 2,
        ..claim(7, 111)
    };
    store
        .write()
        .hold(1, &keys(1, 0..1)[..], cold, &mut holding(1000));
    assert_eq!(prefix_len(&store, 1, 0, 7), 1, "block 0 alone at T2");
    // Stretches read through the word and cell by cell agree.
    for (from, to) in [(0, 1), (0, 30), (1, 30), (5, 29), (0, 64)] {
        stretch_7(&store, 1, from, to);
    }
}

#[test]
fn the_prefix_word_keeps_position_zeros_second() {
    let store = Store::default();
    report_7(&store, 0, 0..3, 10);
    assert_eq!(stretch_7(&store, 0, 0, 3), (3, 10));
    // The blocks after the first refreshed later: still in order.
    report_7(&store, 0, 1..3, 20);
    assert_eq!(prefix_len(&store, 0, 0, 7), 3);
    assert_eq!(stretch_7(&store, 0, 0, 3), (3, 10));
    // The first block alone, at the second the others were seen: the
    // prefix stays, and so must the word's copy of position 0's second.
    report_7(&store, 0, 0..1, 20);
    assert_eq!(prefix_len(&store, 0, 0, 7), 3);
    assert_eq!(stretch_7(&store, 0, 0, 3), (3, 20));
    assert_eq!(stretch_7(&store, 0, 0, 1), (1, 20));
    // A newer first block breaks the order: the prefix is cut and
    // rebuilt from it.
    report_7(&store, 0, 0..1, 30);
    assert_eq!(stretch_7(&store, 0, 0, 3), (3, 20));
    assert_eq!(stretch_7(&store, 0, 0, 1), (1, 30));
}

#[test]
fn room_cap_and_displacement() {
    let store = Store::default();
    let mut w = store.write();
    let mut h = holding(3);
    w.hold(0, &keys(0, 0..5)[..], claim(1, 10), &mut h);
    assert_eq!((h.added, h.refused), (3, 2));
    let mut h = Holding {
        room: 10,
        max_holders: 2,
        ..Holding::default()
    };
    w.hold(0, &keys(0, 0..1)[..], claim(2, 11), &mut h);
    w.hold(0, &keys(0, 0..1)[..], claim(3, 12), &mut h);
    assert_eq!(h.displaced, vec![1], "the stalest holder made room");
    drop(w);
    assert_eq!(held(&store, 0, 0..1, 1), [false]);
    assert_eq!(held(&store, 0, 0..1, 3), [true]);
}

#[test]
fn a_block_named_twice_in_one_report_keeps_one_position() {
    let store = Store::default();
    let mut w = store.write();
    let mut h = holding(1000);
    let mut twice = keys(1, 0..3);
    twice.extend(keys(1, 1..2));
    twice.extend(keys(1, 3..5));
    w.hold(1, &twice[..], claim(7, 100), &mut h);
    assert_eq!((h.added, h.new_keys, h.written), (5, 5, 6));
    assert_eq!(w.shape().0, 5, "five keys");
    drop(w);
    assert_eq!(held(&store, 1, 0..5, 7), vec![true; 5]);
}

#[test]
fn room_running_out_inside_a_stretch_refuses_the_rest() {
    let store = Store::default();
    let mut w = store.write();
    w.hold(1, &keys(1, 0..10)[..], claim(7, 100), &mut holding(1000));
    w.hold(1, &keys(1, 0..5)[..], claim(3, 100), &mut holding(1000));
    // Five refreshes, then room for three of the five new cells.
    let mut h = holding(3);
    w.hold(1, &keys(1, 0..10)[..], claim(3, 101), &mut h);
    assert_eq!((h.written, h.added, h.refused, h.new_keys), (8, 3, 2, 0));
    drop(w);
    let mut expect = vec![true; 8];
    expect.extend([false, false]);
    assert_eq!(held(&store, 1, 0..10, 3), expect);
    // The prefix word agrees with the cells it covers.
    assert_eq!(prefix_len(&store, 1, 0, 3), 8);
}

#[test]
fn wide_chains_append_and_claim_in_runs() {
    let store = Store::default();
    let bytes: Vec<[u8; 16]> = (0..6u8).map(|b| [b; 16]).collect();
    let wide: Vec<(Key<'_>, u32)> = bytes
        .iter()
        .map(|b| (Key::new(2, HashRef::from_bytes(b)), 16))
        .collect();
    let mut w = store.write();
    let mut h = holding(100);
    w.hold(2, &wide[..4], claim(1, 10), &mut h);
    w.hold(2, &wide[..], claim(2, 11), &mut h);
    assert_eq!((h.added, h.new_keys, h.written), (10, 6, 10));
    assert_eq!(w.shape().1, 1, "appended to the one run");
    drop(w);
    let reader = store.reader();
    for (key, _) in &wide {
        let (body, pos) = reader.locate(2, key).expect("stored");
        assert!(body.row(2).is_some_and(|r| body.cell(r, pos).held()));
        assert_eq!(
            body.row(1).is_some_and(|r| body.cell(r, pos).held()),
            pos < 4
        );
    }
}

#[test]
fn clear_frees_runs_and_keys() {
    let store = Store::default();
    let mut w = store.write();
    let mut h = holding(1000);
    for r in 0..3 {
        w.hold(0, &keys(0, 0..70)[..], claim(r, 5), &mut h);
    }
    w.hold(0, &keys(0, 500..501)[..], claim(9, 5), &mut h);
    assert_eq!(w.entries(), 211);
    let mut count = Count(Vec::new());
    w.clear(1, |_| true, &mut count);
    assert_eq!(count.0.len(), 70);
    assert_eq!(w.runs_of(1), 0);
    w.clear(0, |_| true, &mut count);
    w.clear(2, |_| true, &mut count);
    assert_eq!(count.0.iter().filter(|(_, r)| r.is_none()).count(), 70);
    assert_eq!(w.shape().0, 1, "only the other replica's key is left");
    assert_eq!(w.shape().1, 1);
    drop(w);
    assert_eq!(held(&store, 0, 500..501, 9), [true]);
}

/// Every directory slot's data hint names its current body's data, and
/// none is left once the run is freed, through appends, rebuilds for new
/// holders and clears.
fn assert_hints_follow_bodies(store: &Store) {
    let pin = epoch::pin();
    for run in 0..store.write().run_bound() {
        let Some(slot) = store.runs.get(run) else {
            continue;
        };
        let hint = slot.hint().words();
        let len = slot.hint().len();
        match slot.body.load(&pin) {
            Some(body) => {
                assert_eq!(hint, body.data.words.as_ptr(), "run {run}");
                assert_eq!(len, body.len(), "run {run}'s length hint");
            }
            None => assert!(hint.is_null(), "freed run {run} keeps a hint"),
        }
    }
}

#[test]
fn directory_hints_follow_their_bodies() {
    let store = Store::default();
    let mut h = holding(10_000);
    for r in 0..4 {
        store
            .write()
            .hold(0, &keys(0, 0..70)[..], claim(r, 5), &mut h);
        assert_hints_follow_bodies(&store);
    }
    store
        .write()
        .hold(0, &keys(0, 500..530)[..], claim(9, 5), &mut h);
    let mut count = Count(Vec::new());
    for r in 0..4 {
        store.write().clear(r, |_| true, &mut count);
        assert_hints_follow_bodies(&store);
    }
    assert_eq!(held(&store, 0, 500..530, 9), vec![true; 30]);
}

#[test]
fn a_run_hints_where_requests_leave_it() {
    let store = Store::default();
    let mut h = holding(10_000);
    let key = |k: u64| Key::new(0, HashRef::Narrow(k));
    let ahead_of = |k: u64| {
        let reader = store.reader();
        let ahead = reader.touch_run(&key(k));
        (ahead.branch, ahead.end)
    };
    // One report of 40 blocks: one run, nowhere to branch yet.
    store
        .write()
        .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
    assert_eq!(ahead_of(0), (0, 40));
    // Another shares its first 16 blocks, then goes on elsewhere.
    let mut other = keys(0, 0..16);
    other.extend(keys(0, 100..120));
    store.write().hold(0, &other[..], claim(2, 5), &mut h);
    assert_eq!(ahead_of(0), (16, 40));
    // From inside the run both count from the key's position; past the
    // branch only the end is ahead.
    assert_eq!(ahead_of(10), (6, 30));
    assert_eq!(ahead_of(20), (0, 20));
    // A new holder's row rebuilds the body: the branch stays.
    store
        .write()
        .hold(0, &keys(0, 0..40)[..], claim(3, 5), &mut h);
    assert_hints_follow_bodies(&store);
    assert_eq!(ahead_of(0).0, 16);
    // A key the table lacks: nothing ahead.
    assert_eq!(ahead_of(999), (0, 0));
}

/// The entry `parent`'s branch table has for the run that `first`
/// (a key of partition 0) begins, as a reader finds it.
fn branch_entry(store: &Store, parent: u64, first: u64) -> Option<(u32, Lines)> {
    let key = |k: u64| Key::new(0, HashRef::Narrow(k));
    let reader = store.reader();
    let ahead = reader.touch_run(&key(parent));
    ahead.next.and_then(|b| b.find(key(first).probe.tag()))
}

#[test]
fn a_run_names_the_runs_that_continue_it() {
    let store = Store::default();
    let mut h = holding(10_000);
    let run_of = |k: u64| {
        let reader = store.reader();
        let loc = reader
            .table()
            .find(Key::new(0, HashRef::Narrow(k)).probe, |_| true)
            .expect("stored");
        split(loc).0
    };
    let lines_now = |k: u64| {
        let reader = store.reader();
        let (body, pos) = located(&reader, 0, k);
        assert_eq!(pos, 0, "key {k} begins its run");
        lines_of(body)
    };
    // One report: one run, which nothing continues.
    store
        .write()
        .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
    let reader = store.reader();
    assert!(
        reader
            .touch_run(&Key::new(0, HashRef::Narrow(0)))
            .next
            .is_none()
    );
    drop(reader);
    // Two more share its first 16 blocks and go on in runs of their own:
    // the first run names both, with the lines a reader reads there.
    for (r, tail) in [(2, 100..120), (3, 200..230)] {
        let mut report = keys(0, 0..16);
        report.extend(keys(0, tail));
        store.write().hold(0, &report[..], claim(r, 5), &mut h);
    }
    assert_eq!(
        branch_entry(&store, 0, 100),
        Some((run_of(100), lines_now(100)))
    );
    assert_eq!(
        branch_entry(&store, 0, 200),
        Some((run_of(200), lines_now(200)))
    );
    // Asked from inside the run, the same table answers.
    assert_eq!(
        branch_entry(&store, 10, 100).map(|e| e.0),
        Some(run_of(100))
    );
    // A block of the run itself, or one no run begins: no entry.
    assert_eq!(branch_entry(&store, 0, 16), None);
    assert_eq!(branch_entry(&store, 0, 105), None);
    // A second holder rebuilds the run at 100: its entry follows the
    // new body and data.
    let before = lines_now(100);
    let mut report = keys(0, 0..16);
    report.extend(keys(0, 100..120));
    store.write().hold(0, &report[..], claim(4, 5), &mut h);
    assert_ne!(lines_now(100), before, "rebuilt");
    assert_eq!(
        branch_entry(&store, 0, 100),
        Some((run_of(100), lines_now(100)))
    );
    // A freed run leaves its parent's table.
    let mut count = Count(Vec::new());
    store.write().clear(3, |_| true, &mut count);
    assert_eq!(branch_entry(&store, 0, 200), None);
    assert!(branch_entry(&store, 0, 100).is_some());
    // A freed parent takes its table with it, and its children no
    // longer name it.
    let child = run_of(100);
    for r in [1, 2, 4] {
        store.write().clear(r, |_| true, &mut count);
    }
    let w = store.write();
    assert!(w.w.branches.is_empty());
    assert!(w.w.bodies.iter().all(Option::is_none));
    assert_eq!(w.w.links[child as usize].parent, Link::NONE.parent);
}

/// The stored token counts of keys `range` (partition 0), and whether
/// each one's run stores counts.
fn counts_of(store: &Store, range: std::ops::Range<u64>) -> Vec<(u32, bool)> {
    let reader = store.reader();
    range
        .map(|k| {
            let (body, pos) = located(&reader, 0, k);
            (body.count(pos), body.data.counted())
        })
        .collect()
}

/// Keys `range` of 16 tokens each, but the `at`-th with `count`.
fn keys_but(range: std::ops::Range<u64>, (at, count): (usize, u32)) -> Vec<(Key<'static>, u32)> {
    let mut out = keys(0, range);
    out[at].1 = count;
    out
}

/// `n` stored counts of 16, but the `at`-th `count`.
fn stored_but(n: usize, (at, count): (usize, u32)) -> Vec<(u32, bool)> {
    let mut out = vec![(16, true); n];
    out[at].0 = count;
    out
}

#[test]
fn a_run_of_one_token_count_stores_none() {
    let store = Store::default();
    let mut h = holding(10_000);
    // Full blocks: one count for the run, no count words.
    store
        .write()
        .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
    assert_eq!(counts_of(&store, 0..40), vec![(16, false); 40]);
    // A second holder rebuilds the run: still one count.
    store
        .write()
        .hold(0, &keys(0, 0..40)[..], claim(2, 5), &mut h);
    assert_eq!(counts_of(&store, 0..40), vec![(16, false); 40]);
    {
        let reader = store.reader();
        let (body, _) = located(&reader, 0, 0);
        assert_eq!(
            body.data.words.len(),
            HEAD + 40 + 2 + 2 * 40,
            "no count words"
        );
    }
    // A chain whose last block is partial stores its counts.
    let partial = keys_but(100..110, (9, 5));
    store.write().hold(0, &partial[..], claim(1, 5), &mut h);
    assert_eq!(counts_of(&store, 100..110), stored_but(10, (9, 5)));
}

#[test]
fn a_count_a_run_cannot_take_makes_it_store_them_all() {
    let mut h = holding(10_000);
    let held = |range: std::ops::Range<u64>, h: &mut Holding| {
        let store = Store::default();
        store.write().hold(0, &keys(0, range)[..], claim(1, 5), h);
        store
    };
    // A claim of known blocks with other counts (a stretch).
    let store = held(0..20, &mut h);
    let other = keys_but(0..6, (5, 7));
    store.write().hold(0, &other[..], claim(2, 5), &mut h);
    assert_eq!(counts_of(&store, 0..20), stored_but(20, (5, 7)));
    // Block by block (no room left for a new cell: the count is still
    // written).
    let store = held(0..20, &mut h);
    let other = keys_but(3..4, (0, 9));
    store
        .write()
        .hold(0, &other[..], claim(2, 5), &mut holding(0));
    assert_eq!(counts_of(&store, 0..20), stored_but(20, (3, 9)));
    // An append of a block with another count to a run of one count.
    let store = held(0..10, &mut h);
    let longer = keys_but(0..14, (13, 3));
    store.write().hold(0, &longer[..], claim(1, 5), &mut h);
    assert_eq!(counts_of(&store, 0..14), stored_but(14, (13, 3)));
    // Appends and new holders keep them.
    let longer = keys_but(0..30, (13, 3));
    store.write().hold(0, &longer[..], claim(2, 5), &mut h);
    assert_eq!(counts_of(&store, 0..30), stored_but(30, (13, 3)));
}

#[test]
fn branch_lines_place_the_prefix_words_with_and_without_counts() {
    let store = Store::default();
    let mut h = holding(10_000);
    store
        .write()
        .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
    let partial = keys_but(100..109, (8, 5));
    store.write().hold(0, &partial[..], claim(1, 5), &mut h);
    let reader = store.reader();
    for k in [0, 100] {
        let (body, _) = located(&reader, 0, k);
        let [at, data] = lines_of(body);
        assert_eq!(at, std::ptr::from_ref(body) as u64);
        let (words, cap, prefixes) = placed(data);
        assert_eq!(words, body.data.words.as_ptr());
        assert_eq!(cap, body.data.cap());
        assert_eq!(prefixes, std::ptr::from_ref(body.data.prefix(0)), "key {k}");
    }
}

/// The heads table's entry under the tag of key `first`.
fn head_entry(store: &Store, first: u64) -> Option<(u32, [u64; HEAD_LINES])> {
    let reader = store.reader();
    let heads = reader.store.heads.load(&reader.pin)?;
    heads.find(Key::new(0, HashRef::Narrow(first)).probe.tag())
}

/// What the heads table should say of the run key `first` begins,
/// from the run's body, hint and branch table as they are.
fn head_expected(store: &Store, first: u64) -> (u32, [u64; HEAD_LINES]) {
    let reader = store.reader();
    let key = Key::new(0, HashRef::Narrow(first));
    let loc = reader.table().find(key.probe, |_| true).expect("stored");
    let (run, pos) = split(loc);
    assert_eq!(pos, 0, "key {first} begins its run");
    let slot = reader.store.runs.get(run).expect("a slot");
    let body = slot.body.load(&reader.pin).expect("a body");
    let table = slot.branches.load(&reader.pin).expect("a branch table");
    (run, head_lines(body, slot.hint().branch(), table))
}

#[test]
fn a_chains_first_run_others_continue_is_named_in_the_heads_table() {
    let store = Store::default();
    let mut h = holding(100_000);
    let report = |head: std::ops::Range<u64>, tail: std::ops::Range<u64>| {
        let mut r = keys(0, head);
        r.extend(keys(0, tail));
        r
    };
    // A run nothing continues is not named.
    store
        .write()
        .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
    assert_eq!(head_entry(&store, 0), None);
    // After a report, the run of key 0 is named as it is now, with
    // branch position `branch`.
    let named_with = |branch: usize| {
        let entry = head_entry(&store, 0).expect("named");
        assert_eq!(entry, head_expected(&store, 0));
        assert_eq!(head_branch(entry.1[1]), branch, "the branch position");
        entry
    };
    // Continued after its 16th block: named, with its lines, its
    // branch (16) and its branch table.
    store
        .write()
        .hold(0, &report(0..16, 100..120)[..], claim(2, 5), &mut h);
    let entry = named_with(16);
    // A new holder rebuilds its body: the entry follows.
    store
        .write()
        .hold(0, &keys(0, 0..16)[..], claim(3, 5), &mut h);
    assert_ne!(head_entry(&store, 0), Some(entry), "rebuilt");
    assert_eq!(head_entry(&store, 0), Some(head_expected(&store, 0)));
    // A report that leaves it earlier moves the branch.
    store
        .write()
        .hold(0, &report(0..8, 300..310)[..], claim(4, 5), &mut h);
    let entry = named_with(8);
    // Enough runs continue it that its branch table grows: the entry
    // names the new table.
    let place = entry.1[3];
    for k in 0..20u64 {
        let tail = 1_000 + k * 100..1_000 + k * 100 + 4;
        store
            .write()
            .hold(0, &report(0..16, tail)[..], claim(5, 5), &mut h);
    }
    let entry = head_entry(&store, 0).expect("named");
    assert_ne!(entry.1[3], place, "a grown table");
    assert_eq!(entry, head_expected(&store, 0));
    // A run others continue that continues a run itself is not named.
    store
        .write()
        .hold(0, &report(0..26, 500..504)[..], claim(6, 5), &mut h);
    store.write().hold(
        0,
        &[
            &keys(0, 0..16)[..],
            &keys(0, 100..110)[..],
            &keys(0, 600..604)[..],
        ]
        .concat()[..],
        claim(6, 5),
        &mut h,
    );
    assert!(branch_entry(&store, 100, 600).is_some(), "it has a table");
    assert_eq!(head_entry(&store, 100), None);
    // A lookup's touch of it, or of a key no run is named under, only
    // prefetches.
    let reader = store.reader();
    let hashes = BlockHashes::Narrow((0..40u64).map(u64::to_be_bytes).collect());
    reader.touch_head(0, &hashes, &Key::new(0, HashRef::Narrow(0)));
    reader.touch_head(0, &hashes, &Key::new(0, HashRef::Narrow(7_777)));
    drop(reader);
    // Freed, it leaves the table.
    let mut w = store.write();
    let mut count = Count(Vec::new());
    for replica in 1..=6 {
        w.clear(replica, |_| true, &mut count);
    }
    assert_eq!(w.w.heads.len(), 0);
    drop(w);
    assert_eq!(head_entry(&store, 0), None);
}

#[test]
fn a_freed_parent_unlinks_its_children() {
    let store = Store::default();
    let mut h = holding(10_000);
    // Replica 1 holds the head alone; replica 2 the head and a tail.
    store
        .write()
        .hold(0, &keys(0, 0..40)[..], claim(1, 5), &mut h);
    let mut report = keys(0, 0..16);
    report.extend(keys(0, 100..120));
    store.write().hold(0, &report[..], claim(2, 5), &mut h);
    assert!(branch_entry(&store, 0, 100).is_some());
    // The head run goes (both drop it); the tail stays, unlinked.
    let mut count = Count(Vec::new());
    store.write().clear(1, |_| true, &mut count);
    let part_of_head = keys(0, 0..16);
    let mut w = store.write();
    for (key, _) in &part_of_head {
        w.release(0, key, 2);
    }
    assert!(w.w.branches.is_empty(), "the head's table went with it");
    assert_eq!(w.w.heads.len(), 0, "and its heads-table entry");
    // The tail names no parent, and is not taken for a chain's first.
    assert!(
        w.w.links
            .iter()
            .all(|l| l.parent == Link::NONE.parent || l.parent == Link::ORPHAN.parent)
    );
    drop(w);
    assert_eq!(held(&store, 0, 100..120, 2), vec![true; 20]);
    // A new report over the tail's first block links nothing stale.
    store
        .write()
        .hold(0, &keys(0, 0..16)[..], claim(3, 5), &mut h);
    assert!(branch_entry(&store, 0, 100).is_none());
}

#[test]
fn wide_keys_work() {
    let store = Store::default();
    let bytes = [7u8; 16];
    let other = [8u8; 16];
    let mut w = store.write();
    let mut h = holding(10);
    let k = Key::new(0, HashRef::from_bytes(&bytes));
    w.hold(0, &[(k, 32)][..], claim(3, 1), &mut h);
    drop(w);
    let reader = store.reader();
    let (body, pos) = reader.locate(0, &k).expect("stored");
    assert_eq!(body.count(pos), 32);
    assert!(
        reader
            .locate(0, &Key::new(0, HashRef::from_bytes(&other)))
            .is_none()
    );
    assert_eq!(HashRef::from_bytes(&5u64.to_be_bytes()), HashRef::Narrow(5));
}
