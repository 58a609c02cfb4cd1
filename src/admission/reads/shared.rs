//! Quorum reads shared by the requests that wait for them, per key (a Lease): at most one read
//! runs and one waits to start. A request joins the waiting read when there is one; else it
//! starts a read, or — while one runs — queues the next. A request therefore never takes the
//! result of a read that started before it arrived: what it reads is as fresh as a read of its
//! own, which is what fencing needs (a write is admitted only from the holder as of a read made
//! after the write arrived). Concurrent writes of one controller cost one read per round trip,
//! not one each, and a flood of reviews for one Lease cannot make more than two reads at once.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};

type SharedRead<V> = Shared<BoxFuture<'static, V>>;

struct Slot<V: Clone> {
    /// The read in flight, by generation.
    running: Option<(u64, SharedRead<V>)>,
    /// The read that starts when the running one ends; requests arriving now join it.
    queued: Option<(u64, SharedRead<V>)>,
    next: u64,
}

impl<V: Clone> Default for Slot<V> {
    fn default() -> Slot<V> {
        Slot { running: None, queued: None, next: 0 }
    }
}

/// Reads of type `V` shared per key `K`.
pub(crate) struct SharedReads<K, V: Clone> {
    slots: Mutex<HashMap<K, Slot<V>>>,
}

impl<K, V: Clone> Default for SharedReads<K, V> {
    fn default() -> SharedReads<K, V> {
        SharedReads { slots: Mutex::new(HashMap::new()) }
    }
}

impl<K, V> SharedReads<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// The result of a read of `key` that started after this call: joined, or made by `start`.
    pub(crate) async fn read<F, Fut>(self: &Arc<Self>, key: K, start: F) -> V
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = V> + Send + 'static,
    {
        let read = {
            let mut slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let slot = slots.entry(key.clone()).or_default();
            match &slot.queued {
                Some((_, queued)) => queued.clone(),
                None => {
                    let generation = slot.next;
                    slot.next += 1;
                    let before = slot.running.as_ref().map(|(_, running)| running.clone());
                    let (this, key) = (self.clone(), key.clone());
                    let read = async move {
                        if let Some(before) = before {
                            before.await;
                        }
                        this.started(&key, generation);
                        let value = start().await;
                        this.finished(&key, generation);
                        value
                    }
                    .boxed()
                    .shared();
                    if slot.running.is_none() {
                        slot.running = Some((generation, read.clone()));
                    } else {
                        slot.queued = Some((generation, read.clone()));
                    }
                    read
                }
            }
        };
        read.await
    }

    /// The queued read `generation` of `key` starts: later requests queue the next.
    fn started(&self, key: &K, generation: u64) {
        let mut slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(slot) = slots.get_mut(key)
            && slot.queued.as_ref().is_some_and(|(g, _)| *g == generation)
        {
            slot.running = slot.queued.take();
        }
    }

    /// Read `generation` of `key` ended.
    fn finished(&self, key: &K, generation: u64) {
        let mut slots = self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(slot) = slots.get_mut(key) {
            if slot.running.as_ref().is_some_and(|(g, _)| *g == generation) {
                slot.running = None;
            }
            if slot.running.is_none() && slot.queued.is_none() {
                slots.remove(key);
            }
        }
    }

    /// Keys with a read running or queued (tests).
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.slots.lock().map(|s| s.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::Notify;

    /// A read that counts itself, reports its number, and ends when `gate` is notified.
    fn counted(reads: Arc<AtomicUsize>, gate: Arc<Notify>) -> impl FnOnce() -> BoxFuture<'static, usize> + Send + 'static {
        move || {
            async move {
                let n = reads.fetch_add(1, Ordering::SeqCst) + 1;
                gate.notified().await;
                n
            }
            .boxed()
        }
    }

    #[tokio::test]
    async fn requests_share_the_next_read_never_one_that_started_before_them() {
        let shared: Arc<SharedReads<&'static str, usize>> = Arc::default();
        let (reads, gate) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
        // The first request starts read 1.
        let first = tokio::spawn({
            let (s, f) = (shared.clone(), counted(reads.clone(), gate.clone()));
            async move { s.read("lease", f).await }
        });
        while reads.load(Ordering::SeqCst) < 1 {
            tokio::task::yield_now().await;
        }
        // Three more arrive while read 1 runs: they queue read 2, together.
        let later: Vec<_> = (0..3)
            .map(|_| {
                let (s, f) = (shared.clone(), counted(reads.clone(), gate.clone()));
                tokio::spawn(async move { s.read("lease", f).await })
            })
            .collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(reads.load(Ordering::SeqCst), 1, "read 2 waits for read 1");
        gate.notify_one();
        assert_eq!(first.await.ok(), Some(1));
        while reads.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        gate.notify_one();
        for request in later {
            assert_eq!(request.await.ok(), Some(2), "the later requests share read 2, which started after they arrived");
        }
        assert_eq!(reads.load(Ordering::SeqCst), 2);
        assert_eq!(shared.in_flight(), 0, "nothing is kept once the reads ended");
    }

    #[tokio::test]
    async fn keys_do_not_share() {
        let shared: Arc<SharedReads<&'static str, usize>> = Arc::default();
        let reads = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Notify::new());
        let a = tokio::spawn({
            let (s, f) = (shared.clone(), counted(reads.clone(), gate.clone()));
            async move { s.read("a", f).await }
        });
        let b = tokio::spawn({
            let (s, f) = (shared.clone(), counted(reads.clone(), gate.clone()));
            async move { s.read("b", f).await }
        });
        while reads.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        gate.notify_waiters();
        let (a, b) = (a.await.ok(), b.await.ok());
        assert_eq!([a, b].iter().flatten().copied().collect::<std::collections::BTreeSet<_>>(), [1, 2].into());
    }
}
