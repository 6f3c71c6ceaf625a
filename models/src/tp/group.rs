//! The group a rank's forward runs in: [`TpGroup`], and the thread's ([`with_group`]).

use std::cell::RefCell;
use std::sync::Arc;

/// A tensor-parallel group as a model's forward sees it: its ranks and their sum.
pub trait TpGroup: Send + Sync {
    /// This rank's place in the group, `0..size`.
    fn rank(&self) -> usize;
    /// The ranks in the group.
    fn size(&self) -> usize;
    /// `data` replaced by its element-wise sum over the group's ranks, the same bits on every
    /// rank; every rank calls it with the same length, in the same order.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), String>;
}

/// A group held by a forward and by the backward it recorded.
#[derive(Clone)]
pub struct GroupHandle(pub Arc<dyn TpGroup>);

impl std::fmt::Debug for GroupHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tp rank {} of {}", self.0.rank(), self.0.size())
    }
}

thread_local! {
    static GROUP: RefCell<Option<GroupHandle>> = const { RefCell::new(None) };
}

/// Runs `f` with `group` as the thread's tensor-parallel group (none: one device), the one
/// before it restored afterwards, also when `f` panics.
pub fn with_group<T>(group: Option<Arc<dyn TpGroup>>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<GroupHandle>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take();
            GROUP.with(|g| *g.borrow_mut() = before);
        }
    }
    let before = GROUP.with(|g| g.replace(group.map(GroupHandle)));
    let _restore = Restore(before);
    f()
}

/// The thread's tensor-parallel group, if a forward runs in one.
pub fn current() -> Option<GroupHandle> {
    GROUP.with(|g| g.borrow().clone())
}

/// This thread's (rank, size) in its tensor-parallel group; (0, 1) outside one.
pub fn place() -> (usize, usize) {
    current().map_or((0, 1), |g| (g.0.rank(), g.0.size()))
}

/// This thread's part of a tensor cut along `dim` into equal parts over its tensor-parallel
/// group, by rank (a rank's heads): what [`crate::draw::dropout`] keeps of the whole's mask;
/// `None` outside a group.
pub fn part(dim: usize) -> Option<crate::draw::Part> {
    let (index, of) = place();
    (of > 1).then_some(crate::draw::Part { dim, index, of })
}
