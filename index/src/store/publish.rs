//! [`Published`]: a value readers load under an epoch pin with a plain
//! pointer load, touching no reference count (a count shared by every
//! lookup on every core was a cache line they passed between them). The
//! writer swaps values in and retires the old ones (see the `writing`
//! module).

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};

use crossbeam_epoch as epoch;

use super::prefetch_ptr;

/// One published `Arc<T>`, or none, that readers load under an epoch pin
/// without touching its count: the slot owns one strong count, and a value
/// swapped out is dropped only once every reader pinned before the swap
/// has unpinned ([`Writing`](super::Writing) retires it).
pub(super) struct Published<T> {
    ptr: AtomicPtr<T>,
    owns: PhantomData<Arc<T>>,
}

impl<T> Published<T> {
    pub(super) fn empty() -> Self {
        Self {
            ptr: AtomicPtr::new(std::ptr::null_mut()),
            owns: PhantomData,
        }
    }

    pub(super) fn new(value: Arc<T>) -> Self {
        let slot = Self::empty();
        drop(slot.swap(Some(value)));
        slot
    }

    /// The value as of now, valid while `pin` is held (and the slot
    /// lives).
    pub(super) fn load<'a>(&'a self, _pin: &'a epoch::Guard) -> Option<&'a T> {
        let ptr = self.ptr.load(Ordering::Acquire);
        #[expect(
            unsafe_code,
            reason = "an epoch-protected load: no reference count is touched on the read path"
        )]
        // SAFETY: a non-null pointer came from `Arc::into_raw` in `swap`, and
        // the strong count it stands for is released only by dropping what
        // `swap` returned, which the writer retires past every pin taken
        // before the swap, `_pin` included (`Writing::retire`), or by the
        // slot's own drop, which `'a` rules out; the value therefore
        // outlives `'a`. `T` is only read through `&T` (its changing parts
        // are atomics).
        unsafe {
            ptr.as_ref()
        }
    }

    /// Starts the miss on the value's first line (whatever value the slot
    /// holds by then: a hint, never read through).
    pub(super) fn prefetch(&self) {
        prefetch_ptr(self.ptr.load(Ordering::Relaxed));
    }

    /// Publishes `value` (with `Release`: everything written to it before
    /// is visible to a reader that loads it) and hands back the old one's
    /// count, which the caller must retire rather than drop while readers
    /// may hold it.
    pub(super) fn swap(&self, value: Option<Arc<T>>) -> Option<Arc<T>> {
        let new = value.map_or(std::ptr::null_mut(), |v| Arc::into_raw(v).cast_mut());
        let old = self.ptr.swap(new, Ordering::AcqRel);
        #[expect(unsafe_code, reason = "takes back the strong count the slot owned")]
        // SAFETY: a non-null `old` came from `Arc::into_raw` above, and the
        // slot owned that one count, which it gives up here.
        (!old.is_null()).then(|| unsafe { Arc::from_raw(old) })
    }
}

impl<T> Drop for Published<T> {
    fn drop(&mut self) {
        // No reader borrows the store any more.
        drop(self.swap(None));
    }
}
