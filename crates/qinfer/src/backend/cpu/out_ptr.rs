//! A raw output pointer that parallel matmul tasks share, each writing its
//! own disjoint elements.

/// Raw pointer for disjoint parallel writes into one output buffer.
#[derive(Clone, Copy)]
pub(super) struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of elements (its own weight rows).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Where every task writes its own disjoint elements of `out`.
    pub(super) fn new(out: &mut [f32]) -> OutPtr {
        OutPtr(out.as_mut_ptr())
    }
    /// A method (not field access) so closures capture the Send wrapper, not the raw pointer.
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}
